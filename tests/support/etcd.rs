//! A one-member etcd cluster of a test's own: its command line, and stopping it.

use std::ffi::OsStr;
use std::process::{Child, Command, Stdio};

/// `etcd` (the binary `bin`) as a cluster of one member `name`, its data in `dir`, serving
/// clients at the URL `client` and its peer port at `peer`; stdout discarded. The caller sets
/// stderr and spawns it.
pub fn single_member(
    bin: impl AsRef<OsStr>,
    name: &str,
    dir: impl AsRef<OsStr>,
    client: &str,
    peer: &str,
) -> Command {
    let mut c = Command::new(bin);
    c.args(["--name", name, "--data-dir"])
        .arg(dir)
        .args([
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
        ])
        .args([
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
        ])
        .args(["--initial-cluster", &format!("{name}={peer}")])
        .stdout(Stdio::null());
    c
}

/// Kill `child` and reap it, if there is one.
pub fn stop(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}
