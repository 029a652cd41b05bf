//! The file descriptors exported with VMM and pool memory that cross when the endpoints meet
//! (`SCM_RIGHTS`): those this side's descriptors name, sent; those the peer's descriptors name,
//! received and checked (each export once, in order; a peer that sends fewer, more or others is
//! refused, every one received closed).

use super::peer::peer_process;
use super::socket::{os, read_by, send_bound, send_late, timed_out};
use crate::error::{Error, Result};
use crate::p2p::{MAX_FDS_PER_MSG, recv_fds, send_fds};
use crate::transfer::descriptor::MemoryDescriptor;
use crate::transfer::descriptor::{IpcKind, IpcPart};
use crate::transfer::export::published;
use crate::transfer::region::{ExportFd, FdOf};
use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A message of exported file descriptors: `GDXF`, the count (u32), one export id (u64) per
/// descriptor, in the order of the `SCM_RIGHTS` descriptors it carries.
pub(super) const FD_MAGIC: [u8; 4] = *b"GDXF";

const FD_HEAD: usize = 4 + 4;

/// A file descriptor the peer sent when the endpoints met (a VMM allocation's or a pool's), and
/// what its descriptors say it is (every later descriptor naming it must say the same).
#[derive(Debug, Clone)]
pub(super) struct PeerFd {
    pub(super) fd: Arc<OwnedFd>,
    pub(super) of: FdOf,
    pub(super) uuid: [u8; 16],
}

/// The exported file descriptor an IPC part needs (VMM memory, pool memory), and what the part
/// says it is; `None` for a `cuIpc` handle.
pub(super) fn fd_said(p: &IpcPart) -> Option<(u64, FdOf)> {
    match *p.kind() {
        IpcKind::VmmFd { export_id } => Some((export_id, FdOf::Vmm { len: p.alloc_len() })),
        IpcKind::PoolPtr { pool_export_id, .. } => Some((pool_export_id, FdOf::Pool)),
        _ => None,
    }
}

/// What an exported file descriptor is, in words.
pub(super) fn what(of: FdOf) -> String {
    match of {
        FdOf::Vmm { len } => format!("a VMM allocation mapping {len} bytes"),
        FdOf::Pool => "a memory pool".into(),
    }
}

/// The peer's exported file descriptors, by export id, and its pid as the kernel gives it
/// (`SO_PEERCRED`, not the peer's word): what its imports are cached by.
#[derive(Debug)]
pub(super) struct PeerFds {
    pub(super) pid: u32,
    /// The peer is this process (`pid` is ours, asked once when the endpoints met: a request
    /// would otherwise ask the kernel for our pid each time).
    pub(super) this_process: bool,
    pub(super) by_id: HashMap<u64, PeerFd>,
}

/// The most file descriptor exports (VMM allocations, pools) one side's descriptors may name:
/// each is a file descriptor the other side holds for as long as the endpoint lives, out of a
/// per-process limit (often 1,024 open files), so a peer cannot take them all.
pub(crate) const MAX_PEER_FDS: usize = 256;

/// Refused when `n` exports are more than [`MAX_PEER_FDS`]; `arg` names whose descriptors.
fn check_fd_count(arg: &'static str, n: usize) -> Result<()> {
    if n > MAX_PEER_FDS {
        return Err(Error::invalid(
            arg,
            n,
            format!(
                "the descriptors name {n} exported file descriptors (VMM allocations or pools); \
                 an endpoint takes at most {MAX_PEER_FDS} from one side (publish views of fewer \
                 allocations)"
            ),
        ));
    }
    Ok(())
}

/// The file descriptor exports of this process (VMM allocations, pools) that `publish` names,
/// once each, in the order first named; each must be alive and described as it is (what it
/// is, for VMM memory its length, and its GPU).
///
/// # Errors
///
/// [`Error::InvalidArgument`] (`publish`) naming the descriptor, or for more than
/// [`MAX_PEER_FDS`] exports.
pub(super) fn outgoing(publish: &[MemoryDescriptor]) -> Result<Vec<Arc<ExportFd>>> {
    let mut out: Vec<Arc<ExportFd>> = Vec::new();
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for (i, d) in publish.iter().enumerate() {
        let Some(p) = d.ipc() else { continue };
        let Some((id, of)) = fd_said(p) else { continue };
        let v = match seen.get(&id) {
            Some(&k) => out[k].clone(),
            None => {
                let v = published(id).ok_or_else(|| {
                    Error::invalid(
                        "publish",
                        i,
                        format!(
                            "descriptor {i} names the file descriptor export {id} (VMM or \
                             pool), which this process does not hold: its region was dropped, \
                             or the descriptor is another process's"
                        ),
                    )
                })?;
                seen.insert(id, out.len());
                out.push(v.clone());
                v
            }
        };
        if v.of != of || v.uuid != *p.gpu_uuid() {
            return Err(Error::invalid(
                "publish",
                i,
                format!(
                    "descriptor {i} says the export {id} is {}; it is {} (or another GPU's)",
                    what(of),
                    what(v.of)
                ),
            ));
        }
    }
    check_fd_count("publish", out.len())?;
    Ok(out)
}

/// The file descriptor export ids the peer's descriptors name (VMM allocations, pools), once
/// each, in the order first named, with what they say each is and its GPU; descriptors naming
/// one id must agree (a VMM export and a pool export never share one).
///
/// # Errors
///
/// [`Error::InvalidArgument`] (`peer`) naming the descriptor that disagrees, or for more than
/// [`MAX_PEER_FDS`] exports (before any is received).
pub(super) fn expected(descs: &[MemoryDescriptor]) -> Result<Vec<(u64, FdOf, [u8; 16])>> {
    let mut out: Vec<(u64, FdOf, [u8; 16])> = Vec::new();
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for (i, d) in descs.iter().enumerate() {
        let Some(p) = d.ipc() else { continue };
        let Some((id, of)) = fd_said(p) else { continue };
        let said = (id, of, *p.gpu_uuid());
        match seen.get(&id) {
            Some(&k) if out[k] != said => {
                return Err(Error::invalid(
                    "peer",
                    i,
                    format!(
                        "descriptor {i} names the export {id} as {} on another GPU, or as \
                         another kind or length than an earlier descriptor ({})",
                        what(of),
                        what(out[k].1)
                    ),
                ));
            }
            Some(_) => {}
            None => {
                seen.insert(id, out.len());
                out.push(said);
            }
        }
    }
    check_fd_count("peer", out.len())?;
    Ok(out)
}

/// Send the exported file descriptors `fds`, at most [`MAX_FDS_PER_MSG`] a message, each
/// message listing their export ids, by `end` (`timeout` is what the meeting was given, for the
/// error). The send timeout is what is left before each message: a message whose payload the
/// kernel takes in two parts may wait that long once more.
pub(super) fn send_export_fds(
    s: &UnixStream,
    fds: &[Arc<ExportFd>],
    end: Instant,
    timeout: Duration,
) -> Result<()> {
    for batch in fds.chunks(MAX_FDS_PER_MSG) {
        let mut b = Vec::with_capacity(FD_HEAD + 8 * batch.len());
        b.extend_from_slice(&FD_MAGIC);
        // At most MAX_FDS_PER_MSG: fits u32.
        b.extend_from_slice(&(batch.len() as u32).to_le_bytes());
        for v in batch {
            b.extend_from_slice(&v.id.to_le_bytes());
        }
        let raw: Vec<BorrowedFd<'_>> = batch.iter().map(|v| v.fd.as_fd()).collect();
        if !send_bound(s, end)? {
            return Err(send_late(timeout));
        }
        send_fds(s, &raw, &b).map_err(|e| {
            if timed_out(&e) {
                send_late(timeout)
            } else {
                os("sendmsg (the local endpoint's Unix socket)", e)
            }
        })?;
    }
    Ok(())
}

/// Receive the peer's exported file descriptors for `want` (export id, what it is, GPU; in
/// order) by `end`. Every descriptor received is closed again when the peer is refused.
///
/// # Errors
///
/// [`Error::Timeout`] when they do not all come by `end`; [`Error::InvalidArgument`] (`peer`)
/// for a message that is not one of them, more or fewer descriptors than it lists, or an id the
/// peer's descriptors do not name there; [`Error::Os`] from `recvmsg`, or the peer's close.
pub(super) fn recv_export_fds(
    s: &mut UnixStream,
    want: &[(u64, FdOf, [u8; 16])],
    end: Instant,
    timeout: Duration,
) -> Result<PeerFds> {
    let refuse = |why: String| Error::invalid("peer", "its exported file descriptors", why);
    let pid = peer_process(s)?;
    let mut out = PeerFds {
        pid,
        this_process: pid == std::process::id(),
        by_id: HashMap::with_capacity(want.len()),
    };
    let mut buf = vec![0u8; FD_HEAD + 8 * MAX_FDS_PER_MSG];
    let mut at = 0;
    while at < want.len() {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                what: "the peer's exported file descriptors (VMM, pool)",
                after: timeout,
            });
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(|e| os("setsockopt (the local endpoint's Unix socket)", e))?;
        // Room for one more than a message may carry: a peer that sends more is seen doing it.
        let r = match recv_fds(s, &mut buf, MAX_FDS_PER_MSG + 1) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Error::Timeout {
                    what: "the peer's exported file descriptors (VMM, pool)",
                    after: timeout,
                });
            }
            Err(e) => return Err(os("recvmsg (the local endpoint's Unix socket)", e)),
        };
        // From here every descriptor that came is owned by `r.fds`: closed on any refusal.
        if r.len == 0 {
            return Err(os(
                "recvmsg (the local endpoint's Unix socket)",
                std::io::ErrorKind::UnexpectedEof.into(),
            ));
        }
        if r.truncated {
            return Err(refuse(format!(
                "more file descriptors than a message carries ({MAX_FDS_PER_MSG}), or than this \
                 process may open"
            )));
        }
        let mut n = r.len;
        if n < FD_HEAD {
            read_by(s, &mut buf[n..FD_HEAD], end, timeout)?;
            n = FD_HEAD;
        }
        if buf[..4] != FD_MAGIC {
            return Err(refuse(format!(
                "a message starting {:02x?} where its exported file descriptors (GDXF) were due",
                &buf[..4]
            )));
        }
        let count = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes")) as usize;
        let due = (want.len() - at).min(MAX_FDS_PER_MSG);
        if count == 0 || count > due {
            return Err(refuse(format!(
                "a message listing {count} file descriptors where at most {due} were due"
            )));
        }
        let total = FD_HEAD + 8 * count;
        if n > total {
            return Err(refuse(format!(
                "{n} bytes in a message of {count} file descriptors ({total} bytes)"
            )));
        }
        if n < total {
            read_by(s, &mut buf[n..total], end, timeout)?;
        }
        if r.fds.len() != count {
            return Err(refuse(format!(
                "{} file descriptors came with a message listing {count}",
                r.fds.len()
            )));
        }
        for (k, fd) in r.fds.into_iter().enumerate() {
            let at_id = FD_HEAD + 8 * k;
            let id = u64::from_le_bytes(buf[at_id..at_id + 8].try_into().expect("8 bytes"));
            let (want_id, of, uuid) = want[at];
            if id != want_id {
                return Err(refuse(format!(
                    "a file descriptor for the export {id}, where its descriptors name \
                     {want_id} next (each export it names, once, in the order first named)"
                )));
            }
            out.by_id.insert(
                id,
                PeerFd {
                    fd: Arc::new(fd),
                    of,
                    uuid,
                },
            );
            at += 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::descriptor::{DescribedKind, IpcPart};

    /// A descriptor of 4096 bytes of the VMM export `id`.
    fn vmm_desc(id: u64) -> MemoryDescriptor {
        MemoryDescriptor::with_ipc(
            0x7f00_0000_0000,
            4096,
            DescribedKind::Device,
            &[],
            IpcPart::vmm_fd(id, 1 << 21, 0, [7; 16]),
        )
        .unwrap()
    }

    #[test]
    fn a_peer_names_at_most_max_peer_fds_exports() {
        let at_most: Vec<_> = (1..=MAX_PEER_FDS as u64).map(vmm_desc).collect();
        assert_eq!(expected(&at_most).unwrap().len(), MAX_PEER_FDS);
        // Views of exports already named cost nothing more.
        let mut views = at_most.clone();
        views.extend((1..=8).map(vmm_desc));
        assert_eq!(expected(&views).unwrap().len(), MAX_PEER_FDS);
        let mut over = at_most;
        over.push(vmm_desc(MAX_PEER_FDS as u64 + 1));
        let e = expected(&over).unwrap_err();
        assert!(e.to_string().contains("name 257 exported"), "{e}");
        assert!(e.to_string().contains("at most 256"), "{e}");
    }
}
