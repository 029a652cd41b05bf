//! Tier 1, N nodes: named segments and leased membership on a real etcd, between the network
//! namespaces of the Soft-RoCE VM (`NODES=4 bash ci/rxe-vm/run.sh`; ci/rxe-vm/README.md, "N
//! nodes"). Feature `etcd`. Without the VM's environment the test prints `SKIPPED`.
//!
//! One process, the conductor (`n_nodes`, in the VM's root namespace), starts etcd and one node
//! process per namespace (this binary again, running `node_process`), and drives them by lines
//! on their stdin; each node answers with `NNODES-CTL` lines on its stdout. Every node publishes
//! itself as `node-I` with a short TTL and listens on its rxe device. Then:
//!
//! 1. every node connects to every other by name and writes random bytes (a seed per run,
//!    printed) into the other's slot for it, with a notification; the receiver compares them
//!    exactly;
//! 2. the bench: node 1 finds and connects to the 3 others by name, then by address, in paired
//!    rounds (medians), and the store's operations per publish and per connect;
//! 3. the last node is SIGKILLed: the others see it leave the store, their endpoints to it end
//!    with `Error::PeerLeft` within 2 x TTL, and its name is no longer found;
//! 4. the node before it is SIGSTOPped while the others queue more notified writes to it than
//!    it has receives posted: the endpoints end with `PeerLeft` within 2 x TTL and so do the
//!    writes still in flight; resumed, it publishes again and is connected to by name again;
//! 5. etcd is SIGKILLed and restarted on its data, then again on an empty data directory:
//!    engines publish again, no live endpoint ends;
//!
//! with a round of all-to-all writes after each step. The conductor prints `NNODES-CHECK` lines,
//! the timings against 2 x TTL (`NNODES: ... (2 x TTL = ...)`) and `NNODES: N passed, N failed`.
//!
//! The VM's script (ci/rxe-vm/scripts/n-nodes.sh) sets `GPUDIRECT_TEST_NODES` (`NETNS:DEVICE:
//! ADDRESS` per node, space-separated), `GPUDIRECT_TEST_ETCD_BIN`, `GPUDIRECT_TEST_ETCD_ADDR`
//! (where etcd listens, reachable from every node), `GPUDIRECT_TEST_NETNS_EXEC` (the command
//! that runs a program in a namespace), and optionally `GPUDIRECT_TEST_TTL_MS` (default 2000)
//! and `GPUDIRECT_TEST_BENCH_RUNS` (default 7).

mod support;

use gpudirect::Error;
use gpudirect::transfer::membership::{
    Advertise, EtcdConfig, EtcdStore, MemberEvent, MetadataStore, StoreOps,
};
use gpudirect::transfer::{
    Buffer, Endpoint, Engine, EngineConfig, Region, Transfer, TransferListener, TransferOptions,
};
use gpudirect_testing::{Hardware, skip};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::{Duration, Instant};

/// The port every node's listener takes (on its own address).
const PORT: u16 = 7600;
/// etcd's client and peer ports.
const ETCD_PORT: u16 = 2379;
/// Bytes each node writes to each other in a round.
const SLOT: usize = 1 << 20;
/// Notified writes queued to a stopped node: more than the receives it has posted (the
/// engine's `notify_depth`, 64 by default).
const PILE: usize = 160;
/// Tags: a round's write (`ROUND_TAG | round << 8 | from`) and a queued write to a stopped node.
const ROUND_TAG: u32 = 0x1000_0000;
const PILE_TAG: u32 = 0x2000_0000;

/// CLOCK_MONOTONIC in seconds: one clock for every process of the VM.
fn now() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// One node of the VM: its namespace, rxe device and address.
#[derive(Clone, Debug)]
struct Spec {
    netns: String,
    device: String,
    addr: String,
}

/// The VM's environment: the nodes, etcd, the TTL.
#[derive(Clone, Debug)]
struct Env {
    nodes: Vec<Spec>,
    etcd_bin: String,
    etcd_addr: String,
    netns_exec: Vec<String>,
    ttl: Duration,
    bench_runs: usize,
}

fn env() -> Option<Env> {
    let var = |v: &str| std::env::var(v).ok().filter(|s| !s.is_empty());
    let nodes = var("GPUDIRECT_TEST_NODES")?
        .split_whitespace()
        .map(|n| {
            let p: Vec<&str> = n.split(':').collect();
            assert_eq!(
                p.len(),
                3,
                "GPUDIRECT_TEST_NODES: NETNS:DEVICE:ADDRESS, got {n:?}"
            );
            Spec {
                netns: p[0].into(),
                device: p[1].into(),
                addr: p[2].into(),
            }
        })
        .collect::<Vec<_>>();
    assert!(nodes.len() >= 3, "at least 3 nodes");
    let ms = |v: &str, d: u64| var(v).map_or(d, |s| s.parse().expect(v));
    Some(Env {
        nodes,
        etcd_bin: var("GPUDIRECT_TEST_ETCD_BIN").unwrap_or_else(|| "etcd".into()),
        etcd_addr: var("GPUDIRECT_TEST_ETCD_ADDR")?,
        netns_exec: var("GPUDIRECT_TEST_NETNS_EXEC")
            .unwrap_or_else(|| "ip netns exec".into())
            .split_whitespace()
            .map(String::from)
            .collect(),
        ttl: Duration::from_millis(ms("GPUDIRECT_TEST_TTL_MS", 2000)),
        bench_runs: ms("GPUDIRECT_TEST_BENCH_RUNS", 7) as usize,
    })
}

fn name(i: usize) -> String {
    format!("node-{i}")
}

/// The seed of what `from` writes to `to` in `round`.
fn seed_of(seed: u64, from: usize, to: usize, round: u32) -> u64 {
    seed ^ ((from as u64) << 40) ^ ((to as u64) << 32) ^ u64::from(round)
}

/// `key=value` words of a line.
fn fields(words: &str) -> HashMap<String, String> {
    words
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

fn spread(v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.2} [{lo:.2}-{hi:.2}]", median(v))
}

fn ops_diff(a: StoreOps, b: StoreOps) -> String {
    format!(
        "grants={} puts={} gets={} lists={} watches={} keepalives={} revokes={}",
        b.grants - a.grants,
        b.puts - a.puts,
        b.gets - a.gets,
        b.lists - a.lists,
        b.watches - a.watches,
        b.keepalives - a.keepalives,
        b.revokes - a.revokes
    )
}

// ------------------------------------------------------------------------------------------
// The conductor.

/// etcd, started and killed by the conductor.
struct Etcd {
    bin: String,
    addr: String,
    dir: String,
    child: Option<Child>,
}

impl Etcd {
    fn client(&self) -> String {
        format!("{}:{ETCD_PORT}", self.addr)
    }

    /// Start it on its data directory; the seconds until it answered.
    fn start(&mut self) -> f64 {
        let t = now();
        let c = format!("http://{}:{ETCD_PORT}", self.addr);
        let p = format!("http://127.0.0.1:{}", ETCD_PORT + 1);
        let child = support::etcd::single_member(&self.bin, "nnodes", &self.dir, &c, &p)
            .stderr(
                std::fs::File::create(format!("{}.log", self.dir))
                    .map_or_else(|_| Stdio::null(), Stdio::from),
            )
            .spawn()
            .expect("etcd starts");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(90);
        loop {
            if let Ok(s) = EtcdStore::connect(EtcdConfig::new([self.client()])) {
                drop(s);
                return now() - t;
            }
            assert!(Instant::now() < until, "etcd did not answer within 90 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn kill(&mut self) {
        support::etcd::stop(&mut self.child);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A node process as the conductor holds it.
struct Kid {
    child: Child,
    stdin: ChildStdin,
    pid: i32,
}

struct Conductor {
    env: Env,
    kids: Vec<Option<Kid>>,
    /// Nodes not killed or stopped (1-based).
    live: Vec<usize>,
    rx: mpsc::Receiver<(usize, String, f64)>,
    backlog: Vec<(usize, String, f64)>,
    passed: usize,
    failed: usize,
}

impl Conductor {
    fn check(&mut self, what: &str, ok: bool, detail: &str) {
        println!(
            "NNODES-CHECK {} {what}: {detail}",
            if ok { "PASS" } else { "FAIL" }
        );
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
    }

    fn send(&mut self, i: usize, line: &str) {
        if let Some(k) = &mut self.kids[i - 1] {
            let _ = writeln!(k.stdin, "{line}");
            let _ = k.stdin.flush();
        }
    }

    fn signal(&mut self, i: usize, sig: i32) {
        let pid = self.kids[i - 1].as_ref().expect("a node process").pid;
        // SAFETY: kill(2) with a pid of our own child.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
    }

    /// The `word` answer of each of `who`, within `within` (those that did not answer are
    /// missing from the map).
    fn expect(
        &mut self,
        who: &[usize],
        word: &str,
        within: Duration,
    ) -> HashMap<usize, HashMap<String, String>> {
        let until = Instant::now() + within;
        let mut got = HashMap::new();
        let prefix = format!("{word} ");
        let take = |got: &mut HashMap<usize, HashMap<String, String>>, i: usize, l: &str| {
            if who.contains(&i) && (l == word || l.starts_with(&prefix)) && !got.contains_key(&i) {
                got.insert(i, fields(l));
                true
            } else {
                false
            }
        };
        self.backlog.retain(|(i, l, _)| !take(&mut got, *i, l));
        while got.len() < who.len() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match self.rx.recv_timeout(left) {
                Ok((i, l, t)) => {
                    if !take(&mut got, i, &l) {
                        self.backlog.push((i, l, t));
                    }
                }
                Err(_) => break,
            }
        }
        for i in who {
            if !got.contains_key(i) {
                println!("NNODES: node-{i} did not answer {word:?} within {within:?}");
            }
        }
        got
    }

    fn live_list(&self) -> String {
        self.live
            .iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A round of all-to-all writes among the live nodes, each checked by its receiver.
    fn round(&mut self, r: u32, after: &str) {
        let live = self.live.clone();
        let cmd = format!("round {r} {}", self.live_list());
        for &i in &live {
            self.send(i, &cmd);
        }
        let got = self.expect(&live, "round", Duration::from_secs(180));
        let want = live.len() - 1;
        let mut bytes = 0u64;
        let mut ok = got.len() == live.len();
        let mut detail = Vec::new();
        for i in &live {
            let Some(f) = got.get(i) else { continue };
            let n = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            bytes += n("bytes");
            ok &= n("sent") == want as u64 && n("checked") == want as u64 && n("bad") == 0;
            detail.push(format!(
                "node-{i} sent {} checked {} bad {} redialed {}",
                n("sent"),
                n("checked"),
                n("bad"),
                n("redials")
            ));
        }
        println!(
            "NNODES: round {r} ({after}): {} nodes, {bytes} bytes checked exactly by their receivers",
            live.len()
        );
        self.check(
            &format!("all-to-all round {r} ({after})"),
            ok,
            &format!("{bytes} bytes; {}", detail.join(", ")),
        );
    }

    /// Wait for node `i`'s process to end (killed, or told to quit).
    fn reap(&mut self, i: usize, within: Duration) -> Option<std::process::ExitStatus> {
        let k = self.kids[i - 1].as_mut()?;
        let until = Instant::now() + within;
        loop {
            if let Ok(Some(s)) = k.child.try_wait() {
                self.kids[i - 1] = None;
                return Some(s);
            }
            if Instant::now() >= until {
                let _ = k.child.kill();
                let _ = k.child.wait();
                self.kids[i - 1] = None;
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn secs(f: &HashMap<String, String>, k: &str) -> Option<f64> {
    f.get(k).and_then(|v| v.parse().ok())
}

fn fmt_s(v: Option<f64>) -> String {
    v.map_or("never".into(), |v| format!("{v:.2} s"))
}

#[test]
fn n_nodes() {
    if std::env::var("GPUDIRECT_NNODES_ME").is_ok() {
        return; // a node process runs `node_process` only
    }
    let Some(env) = env() else {
        skip(
            Hardware::Rdma,
            "not the N-node VM (GPUDIRECT_TEST_NODES unset; NODES=4 bash ci/rxe-vm/run.sh)",
        );
        return;
    };
    let n = env.nodes.len();
    let ttl = env.ttl;
    let two_ttl = 2.0 * ttl.as_secs_f64();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!(
        "NNODES: {n} nodes, TTL {:.1} s (2 x TTL = {two_ttl:.1} s), seed {seed:#x}",
        ttl.as_secs_f64()
    );
    let dir = "/tmp/nnodes-etcd".to_string();
    let _ = std::fs::remove_dir_all(&dir);
    let mut etcd = Etcd {
        bin: env.etcd_bin.clone(),
        addr: env.etcd_addr.clone(),
        dir: dir.clone(),
        child: None,
    };
    let took = etcd.start();
    println!(
        "NNODES: etcd at {} answered after {took:.1} s",
        etcd.client()
    );

    // The nodes, each in its namespace; their stdout and stderr forwarded line by line.
    let (tx, rx) = mpsc::channel();
    let exe = std::env::current_exe().unwrap();
    let mut kids = Vec::new();
    for (k, s) in env.nodes.iter().enumerate() {
        let i = k + 1;
        let mut c = Command::new(&env.netns_exec[0])
            .args(&env.netns_exec[1..])
            .arg(&s.netns)
            .arg(&exe)
            .args(["--exact", "node_process", "--nocapture", "--test-threads=1"])
            .env("GPUDIRECT_NNODES_ME", i.to_string())
            .env("GPUDIRECT_NNODES_SEED", seed.to_string())
            .env("GPUDIRECT_NNODES_ETCD", etcd.client())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("a node process");
        let out = c.stdout.take().unwrap();
        let err = c.stderr.take().unwrap();
        for (pipe, ctl) in [
            (Box::new(out) as Box<dyn std::io::Read + Send>, true),
            (Box::new(err), false),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    println!("[n{i}] {line}");
                    if ctl && let Some(rest) = line.strip_prefix("NNODES-CTL ") {
                        let _ = tx.send((i, rest.to_string(), now()));
                    }
                }
            });
        }
        let stdin = c.stdin.take().unwrap();
        let pid = c.id() as i32;
        kids.push(Some(Kid {
            child: c,
            stdin,
            pid,
        }));
    }
    drop(tx);
    let mut c = Conductor {
        env: env.clone(),
        kids,
        live: (1..=n).collect(),
        rx,
        backlog: Vec::new(),
        passed: 0,
        failed: 0,
    };
    let all = c.live.clone();

    // Up: published, each its store operations per publish.
    let up = c.expect(&all, "up", Duration::from_secs(180));
    for (i, f) in &up {
        if let Some(p) = f.get("pid").and_then(|p| p.parse().ok()) {
            c.kids[i - 1].as_mut().unwrap().pid = p;
        }
    }
    c.check(
        "every node published itself",
        up.len() == n,
        &format!("{} of {n}", up.len()),
    );
    if up.len() < n {
        return finish(c, etcd);
    }

    // Connect by name, all to all.
    for &i in &all {
        c.send(i, "connect");
    }
    let got = c.expect(&all, "connected", Duration::from_secs(240));
    let ok = got.len() == n
        && got
            .values()
            .all(|f| f.get("n").and_then(|v| v.parse::<usize>().ok()) == Some(n - 1));
    let ms: Vec<String> = got
        .iter()
        .map(|(i, f)| format!("node-{i} {} ms", f.get("ms").map_or("?", String::as_str)))
        .collect();
    c.check(
        "every node connected to every other by name",
        ok,
        &ms.join(", "),
    );
    c.round(1, "all nodes up");

    // The bench: node 1 to the others, by name and by address.
    let runs = c.env.bench_runs;
    c.send(1, &format!("bench {runs}"));
    let got = c.expect(&[1], "bench", Duration::from_secs(600));
    c.check(
        "bench: node-1 connected to the others by name and by address",
        got.get(&1)
            .is_some_and(|f| f.get("ok").map(String::as_str) == Some("1")),
        &format!("{runs} rounds"),
    );

    // SIGKILL the last node.
    let victim = n;
    let others: Vec<usize> = all.iter().copied().filter(|&i| i != victim).collect();
    let t = now();
    c.signal(victim, libc::SIGKILL);
    c.live.retain(|&i| i != victim);
    for &i in &others {
        c.send(i, &format!("gone {victim} {t:.6}"));
    }
    let got = c.expect(&others, "gone", Duration::from_secs(60));
    let _ = c.reap(victim, Duration::from_secs(5));
    for &i in &others {
        let f = got.get(&i).cloned().unwrap_or_default();
        let (store, ep) = (secs(&f, "store"), secs(&f, "ep"));
        let kind = f.get("kind").cloned().unwrap_or_else(|| "none".into());
        println!(
            "NNODES: node-{victim} SIGKILLed: node-{i} saw it leave the store after {}, its endpoint to it \
             ended ({kind}) after {} (2 x TTL = {two_ttl:.1} s); lookup: {}",
            fmt_s(store),
            fmt_s(ep),
            f.get("lookup").map_or("?", String::as_str)
        );
        c.check(
            &format!("node-{i}: the SIGKILLed node-{victim} left within 2 x TTL"),
            kind == "PeerLeft"
                && ep.is_some_and(|e| e <= two_ttl)
                && f.get("lookup").map(String::as_str) == Some("unknown"),
            &format!("endpoint ended {kind} after {}", fmt_s(ep)),
        );
    }
    c.round(2, &format!("node-{victim} killed"));

    // SIGSTOP the node before it, while the others queue notified writes to it.
    let victim = n - 1;
    let others: Vec<usize> = c.live.iter().copied().filter(|&i| i != victim).collect();
    let t = now();
    c.signal(victim, libc::SIGSTOP);
    c.live.retain(|&i| i != victim);
    for &i in &others {
        c.send(i, &format!("stopped {victim} {t:.6}"));
    }
    let got = c.expect(&others, "stopped", Duration::from_secs(90));
    for &i in &others {
        let f = got.get(&i).cloned().unwrap_or_default();
        let (store, ep) = (secs(&f, "store"), secs(&f, "ep"));
        let kind = f.get("kind").cloned().unwrap_or_else(|| "none".into());
        let n_of = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        println!(
            "NNODES: node-{victim} SIGSTOPped: node-{i} saw it leave the store after {}, its endpoint to it \
             ended ({kind}) after {} (2 x TTL = {two_ttl:.1} s); of {PILE} notified writes queued \
             to it: {} done, {} ended PeerLeft, {} otherwise{}",
            fmt_s(store),
            fmt_s(ep),
            n_of("ok"),
            n_of("peer_left"),
            n_of("other"),
            f.get("other_err")
                .map_or(String::new(), |e| format!(" (first: {e})"))
        );
        c.check(
            &format!("node-{i}: the SIGSTOPped node-{victim} left within 2 x TTL"),
            kind == "PeerLeft" && ep.is_some_and(|e| e <= two_ttl),
            &format!("endpoint ended {kind} after {}", fmt_s(ep)),
        );
        c.check(
            &format!("node-{i}: its writes in flight to node-{victim} ended PeerLeft"),
            n_of("peer_left") > 0
                && n_of("other") == 0
                && n_of("ok") + n_of("peer_left") == PILE as u64,
            &format!(
                "{} done, {} PeerLeft, {} other",
                n_of("ok"),
                n_of("peer_left"),
                n_of("other")
            ),
        );
    }
    let t = now();
    c.signal(victim, libc::SIGCONT);
    c.live.push(victim);
    c.live.sort_unstable();
    let live = c.live.clone();
    for &i in &live {
        c.send(i, &format!("resumed {victim} {t:.6}"));
    }
    let got = c.expect(&live, "resumed", Duration::from_secs(90));
    for &i in &live {
        let f = got.get(&i).cloned().unwrap_or_default();
        if i == victim {
            let back = secs(&f, "published");
            println!(
                "NNODES: node-{victim} SIGCONTinued: it found its own record again after {}",
                fmt_s(back)
            );
            c.check(
                &format!("node-{victim} published again after SIGCONT"),
                back.is_some(),
                &fmt_s(back),
            );
        } else {
            let (store, conn) = (secs(&f, "store"), secs(&f, "connect"));
            println!(
                "NNODES: node-{victim} SIGCONTinued: node-{i} saw it join again after {}, connected to it \
                 by name after {}",
                fmt_s(store),
                fmt_s(conn)
            );
            c.check(
                &format!("node-{i} reached the resumed node-{victim} by name"),
                conn.is_some(),
                &format!("connected after {}", fmt_s(conn)),
            );
        }
    }
    c.round(3, &format!("node-{victim} stopped and resumed"));

    // etcd SIGKILLed and restarted: on its data, then empty.
    for (k, empty) in [(4u32, false), (5, true)] {
        let how = if empty {
            "on an empty data directory"
        } else {
            "on its data"
        };
        let t_kill = now();
        etcd.kill();
        if empty {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let took = etcd.start();
        let t_up = now();
        // Every live member's record back in the store.
        let store = EtcdStore::connect(EtcdConfig::new([etcd.client()])).expect("etcd answers");
        let until = Instant::now() + Duration::from_secs(30);
        let want: Vec<String> = c.live.iter().map(|&i| name(i)).collect();
        let back = loop {
            let names: Vec<String> = store
                .members()
                .map(|m| m.into_iter().map(|r| r.name.to_string()).collect())
                .unwrap_or_default();
            if want.iter().all(|w| names.contains(w)) {
                break Some(now() - t_up);
            }
            if Instant::now() >= until {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        drop(store);
        println!(
            "NNODES: etcd SIGKILLed and restarted {how}: answering {took:.1} s after the kill; all {} \
             live members listed {} after it answered",
            want.len(),
            fmt_s(back)
        );
        c.check(
            &format!("etcd restarted {how}: every live member is listed again"),
            back.is_some(),
            &fmt_s(back),
        );
        // Past the roster's grace and a TTL: no endpoint ended meanwhile.
        std::thread::sleep(ttl * 2 + Duration::from_secs(1));
        let live = c.live.clone();
        let cmd = format!("check {t_kill:.6} {}", c.live_list());
        for &i in &live {
            c.send(i, &cmd);
        }
        let got = c.expect(&live, "check", Duration::from_secs(60));
        for &i in &live {
            let f = got.get(&i).cloned().unwrap_or_default();
            let n_of = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok());
            println!(
                "NNODES: etcd restarted {how}: node-{i}: {} endpoints alive, {} ended{}; members {}; \
                 leaves seen {}, joins seen {}",
                n_of("alive").map_or("?".into(), |v| v.to_string()),
                n_of("dead").map_or("?".into(), |v| v.to_string()),
                f.get("dead_kinds")
                    .map_or(String::new(), |d| format!(" ({d})")),
                f.get("members").map_or("?", String::as_str),
                n_of("lefts").map_or("?".into(), |v| v.to_string()),
                n_of("joins").map_or("?".into(), |v| v.to_string()),
            );
            c.check(
                &format!("etcd restarted {how}: node-{i} lost no endpoint"),
                n_of("dead") == Some(0) && n_of("alive") == Some(live.len() as u64 - 1),
                &format!(
                    "alive {:?}, ended {:?}",
                    n_of("alive").unwrap_or(0),
                    n_of("dead").unwrap_or(0)
                ),
            );
        }
        c.round(k, &format!("etcd restarted {how}"));
    }
    finish(c, etcd);
}

/// Tell the nodes to go, stop etcd, print the summary.
fn finish(mut c: Conductor, mut etcd: Etcd) {
    for i in 1..=c.kids.len() {
        c.send(i, "quit");
        if !c.live.contains(&i) && c.kids[i - 1].is_some() {
            c.signal(i, libc::SIGCONT);
        }
    }
    for i in 1..=c.kids.len() {
        if c.kids[i - 1].is_some() {
            let s = c.reap(i, Duration::from_secs(60));
            if c.live.contains(&i) {
                c.check(
                    &format!("node-{i} exited cleanly"),
                    s.is_some_and(|s| s.success()),
                    &format!("{s:?}"),
                );
            }
        }
    }
    etcd.kill();
    println!("NNODES: {} passed, {} failed", c.passed, c.failed);
    assert_eq!(c.failed, 0, "N-node checks failed");
}

// ------------------------------------------------------------------------------------------
// A node.

/// One membership event as this node's watch saw it: when, the name, whether it joined.
type Seen = Vec<(f64, String, bool)>;

/// What the receiving threads found: (round, from, exact) per round's write.
#[derive(Default)]
struct Inbox {
    checks: Mutex<Vec<(u32, usize, bool)>>,
    arrived: Condvar,
    piled: Mutex<u64>,
}

struct Node {
    me: usize,
    seed: u64,
    env: Env,
    engine: Engine,
    /// Endpoints this node dialled, by peer.
    eps: HashMap<usize, Endpoint>,
    seen: Arc<Mutex<Seen>>,
    inbox: Arc<Inbox>,
}

fn ctl(line: impl AsRef<str>) {
    println!("NNODES-CTL {}", line.as_ref());
}

impl Node {
    fn addr(&self, i: usize) -> String {
        format!("{}:{PORT}", self.env.nodes[i - 1].addr)
    }

    /// Connect to `node-i` by name, retrying while it is not published or not listening yet.
    fn dial(&self, i: usize, within: Duration) -> Result<Endpoint, Error> {
        let until = Instant::now() + within;
        loop {
            match self.engine.connect_name(&name(i), &[]) {
                Ok(ep) => return Ok(ep),
                Err(e) if Instant::now() < until => {
                    eprintln!("connect to {}: {e}; retrying", name(i));
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The first event about `node-i` (a join or a leave) at or after `t`: seconds after `t`.
    fn seen_after(&self, i: usize, joined: bool, t: f64) -> Option<f64> {
        let n = name(i);
        self.seen
            .lock()
            .unwrap()
            .iter()
            .find(|(at, who, j)| *at >= t && *who == n && *j == joined)
            .map(|(at, _, _)| at - t)
    }

    /// Wait until `node-i`'s endpoint has failed; (seconds after `t`, the failure).
    fn ended(&self, i: usize, t: f64, within: Duration) -> (Option<f64>, Option<Error>) {
        let Some(ep) = self.eps.get(&i) else {
            return (None, None);
        };
        let until = Instant::now() + within;
        loop {
            let f = ep.failure();
            if let Some(Error::PeerLeft { .. }) = f {
                return (Some(now() - t), f);
            }
            if Instant::now() >= until {
                return (None, f);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kind(e: &Option<Error>) -> String {
        match e {
            None => "none".into(),
            Some(Error::PeerLeft { .. }) => "PeerLeft".into(),
            Some(e) => format!("{e:?}")
                .split(|c: char| !c.is_alphanumeric())
                .next()
                .unwrap_or("?")
                .to_string(),
        }
    }

    /// Write this round's bytes to every live peer; wait until every live peer's bytes here
    /// are checked.
    fn round(&mut self, r: u32, live: &[usize]) {
        let (mut sent, mut bytes, mut redials) = (0, 0u64, 0);
        for &j in live.iter().filter(|&&j| j != self.me) {
            if self.eps.get(&j).is_none_or(|ep| ep.failure().is_some()) {
                redials += 1;
                match self.dial(j, Duration::from_secs(30)) {
                    Ok(ep) => {
                        self.eps.insert(j, ep);
                    }
                    Err(e) => {
                        eprintln!("round {r}: no endpoint to {}: {e}", name(j));
                        continue;
                    }
                }
            }
            let ep = &self.eps[&j];
            let data = support::files::pattern(SLOT, seed_of(self.seed, self.me, j, r));
            let src = self
                .engine
                .register(Buffer::host(data).unwrap())
                .expect("register");
            let peer = ep.peer_descriptors()[0];
            let dst = peer
                .range((self.me * SLOT) as u64, SLOT as u64)
                .expect("the peer's slot for this node");
            let tag = ROUND_TAG | (r << 8) | self.me as u32;
            match ep
                .write(vec![(src.all(), dst)], TransferOptions::notify(tag))
                .and_then(Transfer::wait)
            {
                Ok(rep) => {
                    sent += 1;
                    bytes += rep.bytes;
                }
                Err(e) => eprintln!("round {r}: write to {}: {e}", name(j)),
            }
        }
        let want: Vec<usize> = live.iter().copied().filter(|&j| j != self.me).collect();
        let until = Instant::now() + Duration::from_secs(120);
        let mut checks = self.inbox.checks.lock().unwrap();
        loop {
            let have = want
                .iter()
                .filter(|&&j| checks.iter().any(|&(cr, f, _)| cr == r && f == j))
                .count();
            let left = until.saturating_duration_since(Instant::now());
            if have == want.len() || left.is_zero() {
                break;
            }
            checks = self.inbox.arrived.wait_timeout(checks, left).unwrap().0;
        }
        let mine: Vec<(u32, usize, bool)> = checks.iter().copied().filter(|c| c.0 == r).collect();
        drop(checks);
        let bad = mine.iter().filter(|c| !c.2).count();
        ctl(format!(
            "round r={r} sent={sent} bytes={bytes} checked={} bad={bad} redials={redials}",
            mine.len()
        ));
    }

    /// By name against by address: node 1 to every other, `runs` paired rounds.
    fn bench(&self, runs: usize) {
        let peers: Vec<usize> = (1..=self.env.nodes.len())
            .filter(|&j| j != self.me)
            .collect();
        let (mut by_name, mut by_addr, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let mut gets = Vec::new();
        let mut ok = true;
        for r in 0..runs {
            let mut one = |named: bool| -> Option<f64> {
                let ops = self.engine.store_ops().unwrap();
                let t = Instant::now();
                let mut eps = Vec::new();
                for &j in &peers {
                    let ep = if named {
                        self.engine.connect_name(&name(j), &[])
                    } else {
                        self.engine.connect(&[self.addr(j).as_str()], &[])
                    };
                    match ep {
                        Ok(ep) => eps.push(ep),
                        Err(e) => {
                            eprintln!("bench: connect to {}: {e}", name(j));
                            return None;
                        }
                    }
                }
                let ms = t.elapsed().as_secs_f64() * 1e3;
                if named {
                    let d = self.engine.store_ops().unwrap();
                    gets.push((d.gets - ops.gets) as f64 / peers.len() as f64);
                }
                drop(eps);
                Some(ms)
            };
            // Who goes first alternates round by round.
            let (n, a) = if r % 2 == 0 {
                let n = one(true);
                (n, one(false))
            } else {
                let a = one(false);
                (one(true), a)
            };
            match (n, a) {
                (Some(n), Some(a)) => {
                    by_name.push(n);
                    by_addr.push(a);
                    ratios.push(n / a);
                }
                _ => ok = false,
            }
        }
        println!(
            "NNODES-BENCH connect to {} peers: rounds={} by_name_ms={} by_address_ms={} name/address={} runs: name{:.1?} address{:.1?}",
            peers.len(),
            by_name.len(),
            spread(&by_name),
            spread(&by_addr),
            spread(&ratios),
            by_name,
            by_addr
        );
        println!(
            "NNODES-BENCH store ops per connect_name: gets={:.2} (no other operation)",
            median(&gets)
        );
        ctl(format!("bench ok={}", u8::from(ok && !by_name.is_empty())));
    }

    /// `victim` was SIGKILLed at `t`: when it left, how its endpoint ended, whether it is found.
    fn gone(&mut self, victim: usize, t: f64) {
        let wait = self.env.ttl * 4 + Duration::from_secs(10);
        let (ep, f) = self.ended(victim, t, wait);
        let store = self.seen_after(victim, false, t);
        let lookup = match self.engine.connect_name(&name(victim), &[]) {
            Err(Error::UnknownName { .. }) => "unknown".to_string(),
            Err(e) => format!("error:{}", Self::kind(&Some(e))),
            Ok(_) => "found".to_string(),
        };
        self.eps.remove(&victim);
        ctl(format!(
            "gone node={victim} store={} ep={} kind={} lookup={lookup}",
            store.map_or("none".into(), |s| format!("{s:.3}")),
            ep.map_or("none".into(), |s| format!("{s:.3}")),
            Self::kind(&f)
        ));
    }

    /// `victim` was SIGSTOPped at `t`: queue more notified writes to it than it has receives
    /// posted, then see its endpoint and those writes end.
    fn stopped(&mut self, victim: usize, t: f64) {
        let mut pile = Vec::new();
        if let Some(ep) = self.eps.get(&victim) {
            let src = self
                .engine
                .register(Buffer::host(vec![0x5Au8; 4096]).unwrap())
                .expect("register");
            let dst = ep.peer_descriptors()[0].range(0, 4096).unwrap();
            for _ in 0..PILE {
                let opts = TransferOptions::notify(PILE_TAG | self.me as u32)
                    .deadline(Duration::from_secs(60));
                match ep.write(vec![(src.all(), dst)], opts) {
                    Ok(tr) => pile.push(Ok(tr)),
                    Err(e) => pile.push(Err(e)),
                }
            }
        }
        let wait = self.env.ttl * 4 + Duration::from_secs(10);
        let (ep, f) = self.ended(victim, t, wait);
        let store = self.seen_after(victim, false, t);
        let (mut ok, mut left, mut other) = (0, 0, 0);
        let mut other_err = None;
        for tr in pile {
            match tr.and_then(Transfer::wait) {
                Ok(_) => ok += 1,
                Err(Error::PeerLeft { .. }) => left += 1,
                Err(e) => {
                    other += 1;
                    other_err.get_or_insert_with(|| Self::kind(&Some(e)));
                }
            }
        }
        self.eps.remove(&victim);
        ctl(format!(
            "stopped node={victim} store={} ep={} kind={} ok={ok} peer_left={left} other={other}{}",
            store.map_or("none".into(), |s| format!("{s:.3}")),
            ep.map_or("none".into(), |s| format!("{s:.3}")),
            Self::kind(&f),
            other_err.map_or(String::new(), |e| format!(" other_err={e}"))
        ));
    }

    /// `victim` was SIGCONTinued at `t`. Itself: until its record is back. The others: until
    /// it joins again, then connect to it by name.
    fn resumed(&mut self, victim: usize, t: f64) {
        let until = Instant::now() + Duration::from_secs(60);
        if victim == self.me {
            let mine = self.engine.published().map(|r| r.node);
            let back = loop {
                let found = self
                    .engine
                    .members()
                    .ok()
                    .and_then(|m| m.into_iter().find(|r| r.name.as_str() == name(self.me)))
                    .map(|r| r.node);
                if found.is_some() && found == mine {
                    break Some(now() - t);
                }
                if Instant::now() >= until {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            ctl(format!(
                "resumed published={}",
                back.map_or("none".into(), |s| format!("{s:.3}"))
            ));
            return;
        }
        let store = loop {
            if let Some(s) = self.seen_after(victim, true, t) {
                break Some(s);
            }
            if Instant::now() >= until {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let conn = match self.dial(victim, Duration::from_secs(60)) {
            Ok(ep) => {
                self.eps.insert(victim, ep);
                Some(now() - t)
            }
            Err(e) => {
                eprintln!("connect to the resumed {}: {e}", name(victim));
                None
            }
        };
        ctl(format!(
            "resumed store={} connect={}",
            store.map_or("none".into(), |s| format!("{s:.3}")),
            conn.map_or("none".into(), |s| format!("{s:.3}"))
        ));
    }

    /// After etcd restarted: the endpoints to live peers, the members, the events since `t`.
    fn check(&self, t: f64, live: &[usize]) {
        let (mut alive, mut dead, mut kinds) = (0, 0, Vec::new());
        for j in live.iter().filter(|&&j| j != self.me) {
            match self.eps.get(j).map(Endpoint::failure) {
                Some(None) => alive += 1,
                Some(f) => {
                    dead += 1;
                    kinds.push(format!("{}:{}", name(*j), Self::kind(&f)));
                }
                None => {
                    dead += 1;
                    kinds.push(format!("{}:none", name(*j)));
                }
            }
        }
        let members = self.engine.members().map_or("error".into(), |m| {
            m.iter()
                .map(|r| r.name.to_string())
                .collect::<Vec<_>>()
                .join(",")
        });
        let seen = self.seen.lock().unwrap();
        let lefts = seen.iter().filter(|e| e.0 >= t && !e.2).count();
        let joins = seen.iter().filter(|e| e.0 >= t && e.2).count();
        drop(seen);
        ctl(format!(
            "check alive={alive} dead={dead} members={members} lefts={lefts} joins={joins}{}",
            if kinds.is_empty() {
                String::new()
            } else {
                format!(" dead_kinds={}", kinds.join(","))
            }
        ));
    }
}

/// Accept endpoints until `stop`; each gets a thread that checks the rounds' bytes at their
/// notifications.
fn acceptor(
    listener: TransferListener,
    target: Region,
    me: usize,
    seed: u64,
    inbox: Arc<Inbox>,
    stop: Arc<AtomicBool>,
) {
    let publish = [target.descriptor().unwrap()];
    let mut threads = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let ep = match listener.accept(&publish, Duration::from_millis(500)) {
            Ok(ep) => ep,
            Err(_) => continue,
        };
        let (target, inbox, stop) = (target.clone(), inbox.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            receive(&ep, &target, me, seed, &inbox, &stop);
        }));
    }
    for t in threads {
        let _ = t.join();
    }
}

fn receive(ep: &Endpoint, target: &Region, me: usize, seed: u64, inbox: &Inbox, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let tag = match ep.next_notification(Duration::from_millis(500)) {
            Ok(Some(n)) => n.tag,
            Ok(None) => continue,
            Err(_) => return,
        };
        if tag & 0xF000_0000 == PILE_TAG {
            *inbox.piled.lock().unwrap() += 1;
            continue;
        }
        if tag & 0xF000_0000 != ROUND_TAG {
            continue;
        }
        let (round, from) = ((tag >> 8) & 0xFFFF, (tag & 0xFF) as usize);
        let mut got = vec![0u8; SLOT];
        let exact = target.read_at(from * SLOT, &mut got).is_ok()
            && got == support::files::pattern(SLOT, seed_of(seed, from, me, round));
        println!(
            "node-{me}: round {round}: {SLOT} bytes from node-{from} {}",
            if exact { "exact" } else { "DIFFER" }
        );
        inbox.checks.lock().unwrap().push((round, from, exact));
        inbox.arrived.notify_all();
    }
}

/// This binary run as one node (the conductor starts it in the node's namespace).
#[test]
fn node_process() {
    let Ok(me) = std::env::var("GPUDIRECT_NNODES_ME") else {
        return; // run only by the conductor
    };
    let me: usize = me.parse().unwrap();
    let seed: u64 = std::env::var("GPUDIRECT_NNODES_SEED")
        .unwrap()
        .parse()
        .unwrap();
    let etcd = std::env::var("GPUDIRECT_NNODES_ETCD").unwrap();
    let env = env().expect("the VM's environment");
    let spec = env.nodes[me - 1].clone();
    let engine = Engine::new(EngineConfig::with_devices(&[&spec.device])).expect("engine");
    let listener = engine
        .listen(&format!("{}:{PORT}", spec.addr))
        .expect("listen");
    let target = engine
        .register(Buffer::host(vec![0u8; SLOT * (env.nodes.len() + 1)]).unwrap())
        .expect("register");
    let store = EtcdStore::connect(EtcdConfig::new([etcd.as_str()])).expect("etcd");
    let o0 = store.ops();
    engine.use_store(&store).expect("use_store");
    let o1 = store.ops();
    engine
        .publish_as(
            &name(me),
            &store,
            Advertise::rails([format!("{}:{PORT}", spec.addr)]).ttl(env.ttl),
        )
        .expect("publish");
    let o2 = store.ops();
    println!(
        "NNODES-BENCH store ops of use_store (node-{me}): {}",
        ops_diff(o0, o1)
    );
    println!(
        "NNODES-BENCH store ops per publish (node-{me}): {}",
        ops_diff(o1, o2)
    );

    let stop = Arc::new(AtomicBool::new(false));
    let inbox = Arc::new(Inbox::default());
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let watcher = {
        let (seen, stop) = (seen.clone(), stop.clone());
        let mut w = engine.watch_members().expect("watch");
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match w.next_timeout(Duration::from_millis(100)) {
                    Ok(Some(MemberEvent::Joined(r))) => {
                        seen.lock().unwrap().push((now(), r.name.to_string(), true))
                    }
                    Ok(Some(MemberEvent::Left { name, .. })) => {
                        seen.lock().unwrap().push((now(), name.to_string(), false))
                    }
                    Ok(None) => {}
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
        })
    };
    let accepting = {
        let (target, inbox, stop) = (target.clone(), inbox.clone(), stop.clone());
        std::thread::spawn(move || acceptor(listener, target, me, seed, inbox, stop))
    };
    let mut node = Node {
        me,
        seed,
        env,
        engine,
        eps: HashMap::new(),
        seen,
        inbox,
    };
    ctl(format!("up pid={}", std::process::id()));

    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        let live =
            |s: &str| -> Vec<usize> { s.split(',').filter_map(|v| v.parse().ok()).collect() };
        match w.as_slice() {
            ["connect"] => {
                let t = Instant::now();
                let ops = node.engine.store_ops().unwrap();
                let mut n = 0;
                for j in (1..=node.env.nodes.len()).filter(|&j| j != me) {
                    match node.dial(j, Duration::from_secs(120)) {
                        Ok(ep) => {
                            node.eps.insert(j, ep);
                            n += 1;
                        }
                        Err(e) => eprintln!("connect to {}: {e}", name(j)),
                    }
                }
                let d = node.engine.store_ops().unwrap();
                println!(
                    "NNODES-BENCH store ops of {n} connect_name (node-{me}, with retries while peers published): {}",
                    ops_diff(ops, d)
                );
                ctl(format!(
                    "connected n={n} ms={:.0}",
                    t.elapsed().as_secs_f64() * 1e3
                ));
            }
            ["round", r, l] => node.round(r.parse().unwrap(), &live(l)),
            ["bench", runs] => node.bench(runs.parse().unwrap()),
            ["gone", v, t] => node.gone(v.parse().unwrap(), t.parse().unwrap()),
            ["stopped", v, t] => node.stopped(v.parse().unwrap(), t.parse().unwrap()),
            ["resumed", v, t] => node.resumed(v.parse().unwrap(), t.parse().unwrap()),
            ["check", t, l] => node.check(t.parse().unwrap(), &live(l)),
            ["quit"] => break,
            _ => eprintln!("unknown command {line:?}"),
        }
    }
    println!(
        "node-{me}: {} notified writes queued to a stopped node arrived here",
        node.inbox.piled.lock().unwrap()
    );
    stop.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    let _ = accepting.join();
    drop(node);
    ctl("bye");
}
