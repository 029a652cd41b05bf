//! Work requests: what is posted to a send queue ([`SendRequest`], `struct ibv_send_wr`) or a
//! receive queue ([`RecvRequest`], `struct ibv_recv_wr`).

use super::mr::{AccessFlags, MAX_MESSAGE, MrSlice, RemoteSlice};
use crate::completion::CompletionFlag;
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;

/// The scatter-gather list of a request: the slices it owns until completion.
#[derive(Debug, Clone, Default)]
pub(crate) enum Sg {
    #[default]
    None,
    One(MrSlice),
    Many(Vec<MrSlice>),
}

impl Sg {
    pub(crate) fn from_vec(mut v: Vec<MrSlice>) -> Sg {
        match v.len() {
            0 => Sg::None,
            1 => Sg::One(v.pop().expect("one")),
            _ => Sg::Many(v),
        }
    }

    pub(crate) fn slices(&self) -> &[MrSlice] {
        match self {
            Sg::None => &[],
            Sg::One(s) => std::slice::from_ref(s),
            Sg::Many(v) => v,
        }
    }

    pub(crate) fn total_len(&self) -> u64 {
        self.slices()
            .iter()
            .fold(0u64, |t, s| t.saturating_add(s.len() as u64))
    }

    /// Every slice in the protection domain `pd` of the `queue` (`QP`, `SRQ`) it is posted to.
    pub(crate) fn check_pd(&self, pd: *mut ibv::ibv_pd, queue: &str) -> Result<()> {
        match self.slices().iter().find(|s| s.pd_ptr() != pd) {
            Some(s) => Err(Error::invalid(
                "local",
                format!("{s:?}"),
                format!("the region belongs to another protection domain than the {queue}"),
            )),
            None => Ok(()),
        }
    }

    /// Entries, and the whole message at most 2 GiB.
    fn check(&self, max_sge: u32, queue: &str) -> Result<u32> {
        let n = u32::try_from(self.slices().len()).unwrap_or(u32::MAX);
        if n > max_sge {
            return Err(Error::invalid(
                "sg_list",
                format!("{n} entries"),
                format!("the {queue} allows {max_sge}"),
            ));
        }
        if self.total_len() > MAX_MESSAGE {
            return Err(Error::invalid(
                "sg_list",
                format!("{} bytes", self.total_len()),
                "a message is at most 2 GiB",
            ));
        }
        Ok(n)
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind<'a> {
    Send,
    SendInline(&'a [u8]),
    Write(RemoteSlice),
    WriteInline(&'a [u8], RemoteSlice),
    Read(RemoteSlice),
    CompareSwap {
        remote: RemoteSlice,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote: RemoteSlice,
        add: u64,
    },
}

/// `struct ibv_send_wr`—one send-queue request, owning the slices it uses. Build one with a
/// constructor, adjust it with the chained setters, and post a chain of them with
/// [`QueuePair::post_send`](super::QueuePair::post_send).
///
/// Requests are signaled by default; [`unsignaled`](Self::unsignaled) ones produce no completion
/// on success, and the queue pair signals one in every `signal_every` of them regardless
/// ([`QpCaps::signal_every`](super::QpCaps::signal_every)), and the last of a chain that leaves
/// the send queue or its CQ more than half full, so both drain
/// ([`QueuePair::post_send`](super::QueuePair::post_send)). Signaled or not, a request takes an
/// entry of the send CQ until a completion covering it is polled.
///
/// Lengths are checked when posted: at most 2 GiB per message, a remote range within 2^64 and as
/// long as the local bytes, an atomic target 8 bytes at an 8-byte aligned address.
#[derive(Debug)]
#[must_use = "a work request does nothing until posted"]
#[doc(alias = "ibv_send_wr")]
pub struct SendRequest<'a> {
    pub(crate) kind: Kind<'a>,
    pub(crate) sg: Sg,
    pub(crate) imm: Option<u32>,
    pub(crate) signaled: bool,
    pub(crate) solicited: bool,
    pub(crate) fence: bool,
    pub(crate) tag: u64,
    pub(crate) flag: Option<CompletionFlag>,
    /// `IBV_SEND_INLINE` on a send or write of registered host memory ([`inline_host`]).
    ///
    /// [`inline_host`]: Self::inline_host
    pub(crate) inline: bool,
}

impl<'a> SendRequest<'a> {
    fn new(kind: Kind<'a>, sg: Sg) -> Self {
        SendRequest {
            kind,
            sg,
            imm: None,
            signaled: true,
            solicited: false,
            fence: false,
            tag: 0,
            flag: None,
            inline: false,
        }
    }

    /// `IBV_SEND_INLINE` on a send or RDMA write of registered memory: the provider copies the
    /// bytes into the request during the post, with CPU loads (as a NIC would read them), so
    /// the NIC fetches nothing later. At most the QP's `max_inline_data` bytes (checked when
    /// posted).
    ///
    /// Only for host memory: the caller makes sure no slice lies in GPU memory, which the CPU
    /// cannot load from.
    #[cfg_attr(not(feature = "transfer"), allow(dead_code))]
    pub(crate) fn inline_host(mut self) -> Self {
        self.inline = true;
        self
    }

    /// `IBV_WR_SEND`: send `local` to the peer's next posted receive.
    #[doc(alias = "IBV_WR_SEND")]
    pub fn send(local: MrSlice) -> Self {
        Self::new(Kind::Send, Sg::One(local))
    }

    /// `IBV_WR_SEND` gathering several slices into one message.
    pub fn send_sg(local: Vec<MrSlice>) -> Self {
        Self::new(Kind::Send, Sg::from_vec(local))
    }

    /// `IBV_WR_SEND` with `IBV_SEND_INLINE`: the bytes are copied into the request when posted, so
    /// no region is needed. At most the QP's `max_inline_data` bytes.
    #[doc(alias = "IBV_SEND_INLINE")]
    pub fn send_inline(data: &'a [u8]) -> Self {
        Self::new(Kind::SendInline(data), Sg::None)
    }

    /// `IBV_WR_RDMA_WRITE`: write `local` to the peer's memory at `remote`.
    #[doc(alias = "IBV_WR_RDMA_WRITE")]
    pub fn write(local: MrSlice, remote: RemoteSlice) -> Self {
        Self::new(Kind::Write(remote), Sg::One(local))
    }

    /// `IBV_WR_RDMA_WRITE` gathering several local slices.
    pub fn write_sg(local: Vec<MrSlice>, remote: RemoteSlice) -> Self {
        Self::new(Kind::Write(remote), Sg::from_vec(local))
    }

    /// `IBV_WR_RDMA_WRITE` with `IBV_SEND_INLINE`: `data` is copied when posted.
    pub fn write_inline(data: &'a [u8], remote: RemoteSlice) -> Self {
        Self::new(Kind::WriteInline(data, remote), Sg::None)
    }

    /// `IBV_WR_RDMA_READ`: read the peer's memory at `remote` into `local` (which needs local
    /// write access).
    #[doc(alias = "IBV_WR_RDMA_READ")]
    pub fn read(local: MrSlice, remote: RemoteSlice) -> Self {
        Self::new(Kind::Read(remote), Sg::One(local))
    }

    /// `IBV_WR_RDMA_READ` scattering into several local slices.
    pub fn read_sg(local: Vec<MrSlice>, remote: RemoteSlice) -> Self {
        Self::new(Kind::Read(remote), Sg::from_vec(local))
    }

    /// `IBV_WR_ATOMIC_CMP_AND_SWP`: if the peer's 8-byte word at `remote` equals `compare`, replace
    /// it with `swap`; the old value lands in `local` (8 bytes, local write access). `remote.addr`
    /// must be 8-byte aligned.
    #[doc(alias = "IBV_WR_ATOMIC_CMP_AND_SWP")]
    pub fn compare_swap(local: MrSlice, remote: RemoteSlice, compare: u64, swap: u64) -> Self {
        Self::new(
            Kind::CompareSwap {
                remote,
                compare,
                swap,
            },
            Sg::One(local),
        )
    }

    /// `IBV_WR_ATOMIC_FETCH_AND_ADD`: add `add` to the peer's 8-byte word at `remote`; the old value
    /// lands in `local`. Alignment as for [`compare_swap`](Self::compare_swap).
    #[doc(alias = "IBV_WR_ATOMIC_FETCH_AND_ADD")]
    pub fn fetch_add(local: MrSlice, remote: RemoteSlice, add: u64) -> Self {
        Self::new(Kind::FetchAdd { remote, add }, Sg::One(local))
    }

    /// Carry 32 bits of immediate data (sends and RDMA writes): `IBV_WR_SEND_WITH_IMM` /
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`. Sent big-endian; the receiver's
    /// [`WorkCompletion::imm`](super::WorkCompletion::imm) gives back `imm`. An RDMA write with
    /// immediate consumes a receive at the peer.
    #[doc(alias = "IBV_WR_RDMA_WRITE_WITH_IMM")]
    #[doc(alias = "IBV_WR_SEND_WITH_IMM")]
    pub fn with_imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
        self
    }

    /// No completion on success (`IBV_SEND_SIGNALED` cleared). Errors still complete.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// A completion on success (the default).
    pub fn signaled(mut self) -> Self {
        self.signaled = true;
        self
    }

    /// `IBV_SEND_SOLICITED`: wake a peer waiting for solicited events.
    pub fn solicited(mut self) -> Self {
        self.solicited = true;
        self
    }

    /// `IBV_SEND_FENCE`: wait for earlier RDMA reads and atomics before starting.
    pub fn fence(mut self) -> Self {
        self.fence = true;
        self
    }

    /// A value reported back by [`WorkCompletion::tag`](super::WorkCompletion::tag).
    pub fn tag(mut self, tag: u64) -> Self {
        self.tag = tag;
        self
    }

    /// Set `flag` when this request's completion (or the signaled completion that covers it, or
    /// its flush) is polled: pair it with an [`InFlight`](crate::completion::InFlight) for resources
    /// outside a memory region.
    pub fn notify(mut self, flag: CompletionFlag) -> Self {
        self.flag = Some(flag);
        self
    }

    /// The remote range, for requests that have one.
    fn remote(&self) -> Option<RemoteSlice> {
        match self.kind {
            Kind::Send | Kind::SendInline(_) => None,
            Kind::Write(r) | Kind::WriteInline(_, r) | Kind::Read(r) => Some(r),
            Kind::CompareSwap { remote, .. } | Kind::FetchAdd { remote, .. } => Some(remote),
        }
    }

    /// Check the request against the rules verbs leave to the caller; `max_inline` is the QP's.
    pub(crate) fn validate(&self, max_sge: u32, max_inline: u32) -> Result<()> {
        let n = self.sg.check(max_sge, "QP")?;
        if let Some(r) = self.remote() {
            r.check()?;
        }
        let need_local_write = matches!(
            self.kind,
            Kind::Read(_) | Kind::CompareSwap { .. } | Kind::FetchAdd { .. }
        );
        let lacking = self
            .sg
            .slices()
            .iter()
            .find(|s| !s.access().contains(AccessFlags::LOCAL_WRITE));
        if let (true, Some(s)) = (need_local_write, lacking) {
            return Err(Error::invalid(
                "local",
                format!("{s:?} with {:?}", s.access()),
                "RDMA read and atomic results need a region with LOCAL_WRITE",
            ));
        }
        if self.inline
            && (!matches!(self.kind, Kind::Send | Kind::Write(_))
                || self.sg.total_len() > max_inline as u64)
        {
            return Err(Error::invalid(
                "inline",
                format!("{} bytes", self.sg.total_len()),
                format!("inline goes with sends and writes of at most {max_inline} bytes here"),
            ));
        }
        match self.kind {
            Kind::SendInline(d) | Kind::WriteInline(d, _) if d.len() as u64 > max_inline as u64 => {
                return Err(Error::invalid(
                    "data",
                    format!("{} bytes", d.len()),
                    format!("inline data is at most {max_inline} bytes on this QP"),
                ));
            }
            Kind::Send | Kind::Write(_) | Kind::Read(_) if n == 0 => {
                return Err(Error::invalid(
                    "sg_list",
                    "empty",
                    "needs at least one slice",
                ));
            }
            _ => {}
        }
        match self.kind {
            Kind::Write(r) | Kind::Read(r) if self.sg.total_len() > r.len as u64 => {
                return Err(Error::invalid(
                    "remote",
                    format!("{} bytes", r.len),
                    format!("shorter than the local {} bytes", self.sg.total_len()),
                ));
            }
            Kind::WriteInline(d, r) if d.len() as u64 > r.len as u64 => {
                return Err(Error::invalid(
                    "remote",
                    format!("{} bytes", r.len),
                    format!("shorter than the {} bytes of data", d.len()),
                ));
            }
            Kind::CompareSwap { remote, .. } | Kind::FetchAdd { remote, .. } => {
                if !remote.addr.is_multiple_of(8) || remote.len < 8 {
                    return Err(Error::invalid(
                        "remote",
                        format!("{:#x} (+{})", remote.addr, remote.len),
                        "an atomic target is an 8-byte word at an 8-byte aligned address",
                    ));
                }
                if self.sg.total_len() != 8 || n != 1 {
                    return Err(Error::invalid(
                        "local",
                        format!("{} bytes", self.sg.total_len()),
                        "an atomic result slot is exactly 8 bytes",
                    ));
                }
            }
            _ => {}
        }
        if self.imm.is_some()
            && !matches!(
                self.kind,
                Kind::Send | Kind::SendInline(_) | Kind::Write(_) | Kind::WriteInline(..)
            )
        {
            return Err(Error::invalid(
                "imm",
                "set",
                "immediate data goes with sends and RDMA writes only",
            ));
        }
        Ok(())
    }

    /// Fill `wr` (all but `wr_id`, `next`, `sg_list`).
    pub(crate) fn fill(&self, wr: &mut ibv::ibv_send_wr, signaled: bool) {
        let mut flags = 0;
        if signaled {
            flags |= ibv::IBV_SEND_SIGNALED;
        }
        if self.solicited {
            flags |= ibv::IBV_SEND_SOLICITED;
        }
        if self.fence {
            flags |= ibv::IBV_SEND_FENCE;
        }
        if self.inline {
            flags |= ibv::IBV_SEND_INLINE;
        }
        if let Some(imm) = self.imm {
            wr.__bindgen_anon_1.imm_data = imm.to_be();
        }
        let rdma = |wr: &mut ibv::ibv_send_wr, r: RemoteSlice| {
            wr.wr.rdma = ibv::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: r.addr,
                rkey: r.rkey,
            };
        };
        wr.opcode = match self.kind {
            Kind::Send | Kind::SendInline(_) => {
                if matches!(self.kind, Kind::SendInline(_)) {
                    flags |= ibv::IBV_SEND_INLINE;
                }
                if self.imm.is_some() {
                    ibv::IBV_WR_SEND_WITH_IMM
                } else {
                    ibv::IBV_WR_SEND
                }
            }
            Kind::Write(r) | Kind::WriteInline(_, r) => {
                if matches!(self.kind, Kind::WriteInline(..)) {
                    flags |= ibv::IBV_SEND_INLINE;
                }
                rdma(wr, r);
                if self.imm.is_some() {
                    ibv::IBV_WR_RDMA_WRITE_WITH_IMM
                } else {
                    ibv::IBV_WR_RDMA_WRITE
                }
            }
            Kind::Read(r) => {
                rdma(wr, r);
                ibv::IBV_WR_RDMA_READ
            }
            Kind::CompareSwap {
                remote,
                compare,
                swap,
            } => {
                wr.wr.atomic = ibv::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                    remote_addr: remote.addr,
                    compare_add: compare,
                    swap,
                    rkey: remote.rkey,
                };
                ibv::IBV_WR_ATOMIC_CMP_AND_SWP
            }
            Kind::FetchAdd { remote, add } => {
                wr.wr.atomic = ibv::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                    remote_addr: remote.addr,
                    compare_add: add,
                    swap: 0,
                    rkey: remote.rkey,
                };
                ibv::IBV_WR_ATOMIC_FETCH_AND_ADD
            }
        };
        wr.send_flags = flags;
    }

    /// Inline data, pointed at by a stack SGE when posting (the provider copies it during the call).
    pub(crate) fn inline_data(&self) -> Option<&'a [u8]> {
        match self.kind {
            Kind::SendInline(d) | Kind::WriteInline(d, _) => Some(d),
            _ => None,
        }
    }
}

/// `struct ibv_recv_wr`—a receive buffer for the next incoming send (or write with immediate),
/// owning its slices (which need [`AccessFlags::LOCAL_WRITE`]) until completion.
#[derive(Debug)]
#[must_use = "a receive request does nothing until posted"]
#[doc(alias = "ibv_recv_wr")]
pub struct RecvRequest {
    pub(crate) sg: Sg,
    pub(crate) tag: u64,
    pub(crate) flag: Option<CompletionFlag>,
}

impl RecvRequest {
    fn with(sg: Sg) -> Self {
        RecvRequest {
            sg,
            tag: 0,
            flag: None,
        }
    }

    /// Receive into `local`.
    pub fn new(local: MrSlice) -> Self {
        Self::with(Sg::One(local))
    }

    /// Receive scattered over several slices.
    pub fn sg(local: Vec<MrSlice>) -> Self {
        Self::with(Sg::from_vec(local))
    }

    /// No buffer: only for RDMA writes with immediate (which carry no payload to this queue).
    pub fn empty() -> Self {
        Self::with(Sg::None)
    }

    /// A value reported back by [`WorkCompletion::tag`](super::WorkCompletion::tag).
    pub fn tag(mut self, tag: u64) -> Self {
        self.tag = tag;
        self
    }

    /// Set `flag` when this receive's completion (or flush) is polled.
    pub fn notify(mut self, flag: CompletionFlag) -> Self {
        self.flag = Some(flag);
        self
    }

    pub(crate) fn validate(&self, max_sge: u32) -> Result<()> {
        self.sg.check(max_sge, "queue")?;
        if let Some(s) = self
            .sg
            .slices()
            .iter()
            .find(|s| !s.access().contains(AccessFlags::LOCAL_WRITE))
        {
            return Err(Error::invalid(
                "local",
                format!("{s:?} with {:?}", s.access()),
                "a receive buffer needs a region with LOCAL_WRITE",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::mr::fake_region;
    use proptest::prelude::*;

    fn remote() -> impl Strategy<Value = RemoteSlice> {
        let addr = prop_oneof![
            (u64::MAX - 10_000)..=u64::MAX,
            0u64..(1 << 20),
            any::<u64>()
        ];
        let len = prop_oneof![0u32..64, Just(u32::MAX), any::<u32>()];
        (addr, len).prop_map(|(addr, len)| RemoteSlice { addr, rkey: 7, len })
    }

    proptest! {
        /// Requests of every kind with random local slices, remote ranges, inline data and QP
        /// limits: refused exactly when a rule is broken, never a panic, never a wrapped range.
        #[test]
        fn requests_are_validated_by_the_rules(
            kind in 0u8..7, r in remote(), max_sge in 0u32..4, max_inline in 0u32..300,
            cuts in proptest::collection::vec((0usize..4096, 1usize..4096), 0..4),
            inline_len in 0usize..400, write_access in any::<bool>(), imm in any::<bool>(),
            cmp in any::<u64>(), host_inline in any::<bool>(),
        ) {
            let access = if write_access { AccessFlags::LOCAL_WRITE } else { AccessFlags::empty() };
            let mr = fake_region(0x1000, 8192, access);
            let sl: Vec<MrSlice> = cuts
                .iter()
                .filter_map(|&(o, l)| MrSlice::of(&mr, o..o + l).ok())
                .collect();
            let data = vec![0u8; inline_len];
            let w = match kind {
                0 => SendRequest::send_sg(sl.clone()),
                1 => SendRequest::send_inline(&data),
                2 => SendRequest::write_sg(sl.clone(), r),
                3 => SendRequest::write_inline(&data, r),
                4 => SendRequest::read_sg(sl.clone(), r),
                5 => SendRequest::compare_swap(
                    sl.first().cloned().unwrap_or_else(|| MrSlice::of(&mr, ..8).unwrap()), r, cmp, 1),
                _ => SendRequest::fetch_add(
                    sl.first().cloned().unwrap_or_else(|| MrSlice::of(&mr, ..8).unwrap()), r, cmp),
            };
            let w = if imm { w.with_imm(5) } else { w };
            let w = if host_inline { w.inline_host() } else { w };
            let n = w.sg.slices().len() as u32;
            let total: u64 = w.sg.slices().iter().map(|s| s.len() as u64).sum();
            let remote_ok = r.addr.checked_add(r.len as u64).is_some() && r.len as u64 <= 1 << 31;
            let ok = n <= max_sge
                && total <= 1 << 31
                && match kind {
                    0 => n > 0,
                    1 => inline_len as u64 <= max_inline as u64,
                    2 => remote_ok && n > 0 && total <= r.len as u64,
                    3 => remote_ok && inline_len as u64 <= max_inline as u64
                        && inline_len as u64 <= r.len as u64,
                    4 => remote_ok && n > 0 && total <= r.len as u64 && write_access,
                    _ => remote_ok && r.addr % 8 == 0 && r.len >= 8 && total == 8 && n == 1
                        && write_access,
                }
                && (!imm || kind <= 3)
                // Inline registered memory: sends and writes of slices, within max_inline.
                && (!host_inline || ((kind == 0 || kind == 2) && total <= max_inline as u64));
            match w.validate(max_sge, max_inline) {
                Ok(()) => prop_assert!(ok, "accepted {:?}", w),
                Err(Error::InvalidArgument { .. }) => prop_assert!(!ok, "refused {:?}", w),
                Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
            }
        }

        /// Receives: at most `max_sge` slices, of a region with local write.
        #[test]
        fn receives_are_validated(
            max_sge in 0u32..4, write_access in any::<bool>(),
            cuts in proptest::collection::vec((0usize..4096, 1usize..4096), 0..5),
        ) {
            let access = if write_access { AccessFlags::LOCAL_WRITE } else { AccessFlags::empty() };
            let mr = fake_region(u64::MAX - 9000, 8192, access);
            let sl: Vec<MrSlice> = cuts
                .iter()
                .filter_map(|&(o, l)| MrSlice::of(&mr, o..o + l).ok())
                .collect();
            let n = sl.len() as u32;
            let r = RecvRequest::sg(sl);
            let ok = n <= max_sge && (n == 0 || write_access);
            prop_assert_eq!(r.validate(max_sge).is_ok(), ok);
        }
    }
}
