//! The `static inline` verbs of `<infiniband/verbs.h>`, which have no symbol in libibverbs: they
//! call through the provider's function pointers in `ibv_context::ops` (and, for
//! `ibv_query_port`, the extended `verbs_context` that sits in memory just before the
//! `ibv_context`). Each follows the header's body; the layouts they read are asserted in the tests
//! below.

use super::bindings::*;
use super::lib;
use core::ffi::c_int;
use core::mem::offset_of;

/// `ENOSYS`, answered when a provider leaves a data-path op NULL.
const ENOSYS: c_int = 38;

/// `ibv_post_send(qp, wr, bad_wr)`: post a chain of send work requests. Returns 0 or an errno;
/// on failure `*bad_wr` points at the first request not posted.
///
/// # Safety
///
/// `qp` is a live QP of an open context; `wr` is a valid chain whose SG lists and (for non-inline
/// requests) the memory they reference stay valid until their completions; `bad_wr` is writable.
#[inline]
pub unsafe fn ibv_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: the caller guarantees a live QP; its context outlives it.
    let op = unsafe { (*(*qp).context).ops.post_send };
    match op {
        // SAFETY: the provider's op, called as the header does.
        Some(f) => unsafe { f(qp, wr, bad_wr) },
        None => ENOSYS,
    }
}

/// `ibv_post_recv(qp, wr, bad_wr)`: post a chain of receive work requests. Returns 0 or an errno.
///
/// # Safety
///
/// As [`ibv_post_send`]; the memory is written by the NIC until the completion.
#[inline]
pub unsafe fn ibv_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller guarantees a live QP.
    let op = unsafe { (*(*qp).context).ops.post_recv };
    match op {
        // SAFETY: the provider's op.
        Some(f) => unsafe { f(qp, wr, bad_wr) },
        None => ENOSYS,
    }
}

/// `ibv_post_srq_recv(srq, wr, bad_wr)`: post receives to a shared receive queue.
///
/// # Safety
///
/// As [`ibv_post_recv`], for a live SRQ.
#[inline]
pub unsafe fn ibv_post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller guarantees a live SRQ.
    let op = unsafe { (*(*srq).context).ops.post_srq_recv };
    match op {
        // SAFETY: the provider's op.
        Some(f) => unsafe { f(srq, wr, bad_wr) },
        None => ENOSYS,
    }
}

/// `ibv_poll_cq(cq, num_entries, wc)`: fetch up to `num_entries` completions into `wc`. Returns
/// how many (>= 0) or a negative value on error.
///
/// # Safety
///
/// `cq` is a live CQ; `wc` has room for `num_entries` entries.
#[inline]
pub unsafe fn ibv_poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: the caller guarantees a live CQ.
    let op = unsafe { (*(*cq).context).ops.poll_cq };
    match op {
        // SAFETY: the provider's op.
        Some(f) => unsafe { f(cq, num_entries, wc) },
        None => -ENOSYS,
    }
}

/// `ibv_req_notify_cq(cq, solicited_only)`: arm the CQ's completion channel for the next
/// (solicited) completion. Returns 0 or an errno.
///
/// # Safety
///
/// `cq` is a live CQ.
#[inline]
pub unsafe fn ibv_req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: the caller guarantees a live CQ.
    let op = unsafe { (*(*cq).context).ops.req_notify_cq };
    match op {
        // SAFETY: the provider's op.
        Some(f) => unsafe { f(cq, solicited_only) },
        None => ENOSYS,
    }
}

/// `EOPNOTSUPP`, the errno `ibv_alloc_mw` leaves when the provider has no `alloc_mw` op.
const EOPNOTSUPP: c_int = 95;

/// `ibv_alloc_mw(pd, type)`: allocate an unbound memory window of `type` (`IBV_MW_TYPE_1`,
/// `IBV_MW_TYPE_2`) in `pd`. Returns NULL with errno set on failure; `EOPNOTSUPP` when the
/// provider has no memory windows, as the header does.
///
/// # Safety
///
/// `pd` is a live protection domain of an open context.
#[inline]
pub unsafe fn ibv_alloc_mw(pd: *mut ibv_pd, type_: ibv_mw_type) -> *mut ibv_mw {
    // SAFETY: the caller guarantees a live PD; its context outlives it.
    let op = unsafe { (*(*pd).context).ops.alloc_mw };
    match op {
        // SAFETY: the provider's op, called as the header does.
        Some(f) => unsafe { f(pd, type_) },
        None => {
            // SAFETY: the calling thread's errno.
            unsafe { *libc::__errno_location() = EOPNOTSUPP };
            core::ptr::null_mut()
        }
    }
}

/// `ibv_dealloc_mw(mw)`: unbind (if bound) and free a memory window. Returns 0 or an errno
/// (`ENOSYS` when the provider has no `dealloc_mw` op, where the header would call NULL).
///
/// # Safety
///
/// `mw` is a live window from [`ibv_alloc_mw`], not used again after success.
#[inline]
pub unsafe fn ibv_dealloc_mw(mw: *mut ibv_mw) -> c_int {
    // SAFETY: the caller guarantees a live window; its context outlives it.
    let op = unsafe { (*(*mw).context).ops.dealloc_mw };
    match op {
        // SAFETY: the provider's op.
        Some(f) => unsafe { f(mw) },
        None => ENOSYS,
    }
}

/// `ibv_inc_rkey(rkey)`: the key a bind gives a window next: the low 8 bits (the key's tag)
/// incremented, wrapping; the upper 24 (the window's index) unchanged.
#[inline]
pub const fn ibv_inc_rkey(rkey: u32) -> u32 {
    const MASK: u32 = 0xff;
    (rkey & !MASK) | (rkey.wrapping_add(1) & MASK)
}

/// The header's `__VERBS_ABI_IS_EXTENDED`: `abi_compat` of a context embedded in a
/// `verbs_context`.
const VERBS_ABI_IS_EXTENDED: usize = usize::MAX;

/// `verbs_get_ctx(ctx)`: the `verbs_context` around `ctx`, when the provider made one.
///
/// # Safety
///
/// `ctx` is a live context.
pub unsafe fn verbs_get_ctx(ctx: *mut ibv_context) -> Option<*mut verbs_context> {
    // SAFETY: the caller guarantees a live context.
    if unsafe { (*ctx).abi_compat } as usize != VERBS_ABI_IS_EXTENDED {
        return None;
    }
    // container_of(ctx, struct verbs_context, context)
    Some(
        ctx.cast::<u8>()
            .wrapping_sub(offset_of!(verbs_context, context))
            .cast(),
    )
}

/// `ibv_query_port(ctx, port_num, port_attr)` as the header's inline `___ibv_query_port`: the
/// extended `query_port` op when the provider has it, else the exported compat symbol on a zeroed
/// struct. Returns 0 or an errno (or -1 with errno when the library is absent).
///
/// # Safety
///
/// `ctx` is a live context; `port_attr` is writable.
pub unsafe fn ibv_query_port(
    ctx: *mut ibv_context,
    port_num: u8,
    port_attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: live context per the caller.
    if let Some(vctx) = unsafe { verbs_get_ctx(ctx) } {
        // verbs_get_ctx_op: the op exists only if the provider's struct is large enough.
        let need = size_of::<verbs_context>() - offset_of!(verbs_context, query_port);
        // SAFETY: `vctx` is the provider's verbs_context; `sz` and `query_port` are in it.
        let (sz, op) = unsafe { ((*vctx).sz, (*vctx).query_port) };
        if let (true, Some(f)) = (sz >= need, op) {
            // SAFETY: the provider's extended op, with the size of our struct.
            return unsafe { f(ctx, port_num, port_attr, size_of::<ibv_port_attr>()) };
        }
    }
    // SAFETY: writable per the caller.
    unsafe { core::ptr::write_bytes(port_attr, 0, 1) };
    match lib() {
        // SAFETY: the compat symbol fills a prefix of the zeroed struct.
        Ok(l) => unsafe { (l.ibv_query_port)(ctx, port_num, port_attr) },
        Err(_) => ENOSYS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    // Offsets and sizes from rdma-core's headers on x86_64/aarch64 (LP64). A provider reads these
    // structs by the same layout, so a wrong binding here is caught before it reaches a NIC.
    #[test]
    fn data_path_layouts_match_the_abi() {
        assert_eq!(size_of::<ibv_sge>(), 16);
        assert_eq!(offset_of!(ibv_sge, addr), 0);
        assert_eq!(offset_of!(ibv_sge, length), 8);
        assert_eq!(offset_of!(ibv_sge, lkey), 12);

        assert_eq!(size_of::<ibv_send_wr>(), 128);
        assert_eq!(offset_of!(ibv_send_wr, wr_id), 0);
        assert_eq!(offset_of!(ibv_send_wr, next), 8);
        assert_eq!(offset_of!(ibv_send_wr, sg_list), 16);
        assert_eq!(offset_of!(ibv_send_wr, num_sge), 24);
        assert_eq!(offset_of!(ibv_send_wr, opcode), 28);
        assert_eq!(offset_of!(ibv_send_wr, send_flags), 32);
        assert_eq!(offset_of!(ibv_send_wr, __bindgen_anon_1), 36); // imm_data / invalidate_rkey
        assert_eq!(offset_of!(ibv_send_wr, wr), 40);
        assert_eq!(offset_of!(ibv_send_wr, __bindgen_anon_2), 80); // bind_mw / tso
        assert_eq!(align_of::<ibv_send_wr>(), 8);
        type BindMw = ibv_send_wr__bindgen_ty_4__bindgen_ty_1;
        assert_eq!(offset_of!(BindMw, mw), 0);
        assert_eq!(offset_of!(BindMw, rkey), 8);
        assert_eq!(offset_of!(BindMw, bind_info), 16);
        assert_eq!(size_of::<BindMw>(), 48);
        assert_eq!(offset_of!(ibv_mw_bind_info, mr), 0);
        assert_eq!(offset_of!(ibv_mw_bind_info, addr), 8);
        assert_eq!(offset_of!(ibv_mw_bind_info, length), 16);
        assert_eq!(offset_of!(ibv_mw_bind_info, mw_access_flags), 24);
        assert_eq!(offset_of!(ibv_mw, context), 0);
        assert_eq!(offset_of!(ibv_mw, pd), 8);
        assert_eq!(offset_of!(ibv_mw, rkey), 16);
        assert_eq!(offset_of!(ibv_mw, handle), 20);
        assert_eq!(offset_of!(ibv_mw, type_), 24);

        assert_eq!(size_of::<ibv_recv_wr>(), 32);
        assert_eq!(offset_of!(ibv_recv_wr, sg_list), 16);
        assert_eq!(offset_of!(ibv_recv_wr, num_sge), 24);

        assert_eq!(size_of::<ibv_wc>(), 48);
        assert_eq!(offset_of!(ibv_wc, wr_id), 0);
        assert_eq!(offset_of!(ibv_wc, status), 8);
        assert_eq!(offset_of!(ibv_wc, opcode), 12);
        assert_eq!(offset_of!(ibv_wc, vendor_err), 16);
        assert_eq!(offset_of!(ibv_wc, byte_len), 20);
        assert_eq!(offset_of!(ibv_wc, __bindgen_anon_1), 24); // imm_data
        assert_eq!(offset_of!(ibv_wc, qp_num), 28);
        assert_eq!(offset_of!(ibv_wc, src_qp), 32);
        assert_eq!(offset_of!(ibv_wc, wc_flags), 36);
    }

    #[test]
    fn ops_table_layout_matches_the_abi() {
        let p = size_of::<usize>();
        // struct ibv_context_ops, counting the _compat_ placeholders: poll_cq is the 12th
        // pointer, post_srq_recv the 21st, post_send the 26th, post_recv the 27th; alloc_mw,
        // bind_mw and dealloc_mw the 8th to 10th.
        assert_eq!(offset_of!(ibv_context_ops, alloc_mw), 7 * p);
        assert_eq!(offset_of!(ibv_context_ops, bind_mw), 8 * p);
        assert_eq!(offset_of!(ibv_context_ops, dealloc_mw), 9 * p);
        assert_eq!(offset_of!(ibv_context_ops, poll_cq), 11 * p);
        assert_eq!(offset_of!(ibv_context_ops, req_notify_cq), 12 * p);
        assert_eq!(offset_of!(ibv_context_ops, post_srq_recv), 20 * p);
        assert_eq!(offset_of!(ibv_context_ops, post_send), 25 * p);
        assert_eq!(offset_of!(ibv_context_ops, post_recv), 26 * p);
        assert_eq!(offset_of!(ibv_context, device), 0);
        assert_eq!(offset_of!(ibv_context, ops), p);
        assert_eq!(offset_of!(ibv_qp, context), 0);
        assert_eq!(offset_of!(ibv_cq, context), 0);
        assert_eq!(offset_of!(ibv_srq, context), 0);
        assert_eq!(offset_of!(ibv_mr, handle), 32);
        assert_eq!(offset_of!(ibv_mr, lkey), 36);
        assert_eq!(offset_of!(ibv_mr, rkey), 40);
        assert_eq!(size_of::<ibv_port_attr>(), 52);
        assert_eq!(size_of::<ibv_gid>(), 16);
        // verbs_context ends with the ibv_context it wraps.
        assert_eq!(
            offset_of!(verbs_context, context) + size_of::<ibv_context>(),
            size_of::<verbs_context>()
        );
    }

    /// A fake provider: the inline verbs must call exactly the ops the header calls.
    #[test]
    fn inline_verbs_call_the_context_ops() {
        unsafe extern "C" fn post_send(
            _qp: *mut ibv_qp,
            wr: *mut ibv_send_wr,
            _bad: *mut *mut ibv_send_wr,
        ) -> c_int {
            // SAFETY: the test passes a valid WR.
            unsafe { (*wr).wr_id as c_int }
        }
        unsafe extern "C" fn poll_cq(_cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
            // SAFETY: the test passes room for n entries.
            unsafe { (*wc).wr_id = 77 };
            n - 1
        }
        let mut ctx: ibv_context = Default::default();
        ctx.ops.post_send = Some(post_send);
        ctx.ops.poll_cq = Some(poll_cq);
        let mut qp = ibv_qp {
            context: &mut ctx,
            ..Default::default()
        };
        let mut cq = ibv_cq {
            context: &mut ctx,
            ..Default::default()
        };
        let mut wr = ibv_send_wr {
            wr_id: 5,
            ..Default::default()
        };
        let mut bad = core::ptr::null_mut();
        // SAFETY: fake objects that live for the call.
        assert_eq!(unsafe { ibv_post_send(&mut qp, &mut wr, &mut bad) }, 5);
        let mut wc = [ibv_wc::default(); 4];
        // SAFETY: as above, 4 entries of room.
        assert_eq!(unsafe { ibv_poll_cq(&mut cq, 4, wc.as_mut_ptr()) }, 3);
        assert_eq!(wc[0].wr_id, 77);
        // No op: ENOSYS, never a call through NULL.
        let null = core::ptr::null_mut();
        // SAFETY: as above.
        let r = unsafe { ibv_post_recv(&mut qp, null, core::ptr::null_mut()) };
        assert_eq!(r, ENOSYS);
        // SAFETY: as above.
        assert_eq!(unsafe { ibv_req_notify_cq(&mut cq, 0) }, ENOSYS);
    }

    /// The window verbs call the provider's ops; without them, `EOPNOTSUPP` (alloc, as the
    /// header) and `ENOSYS` (dealloc), never a call through NULL.
    #[test]
    fn window_verbs_call_the_context_ops() {
        unsafe extern "C" fn alloc_mw(pd: *mut ibv_pd, type_: ibv_mw_type) -> *mut ibv_mw {
            let mw = Box::new(ibv_mw {
                // SAFETY: the test's PD.
                context: unsafe { (*pd).context },
                pd,
                rkey: 0x0004_01ff,
                type_,
                ..Default::default()
            });
            Box::into_raw(mw)
        }
        unsafe extern "C" fn dealloc_mw(mw: *mut ibv_mw) -> c_int {
            // SAFETY: made by alloc_mw above.
            drop(unsafe { Box::from_raw(mw) });
            0
        }
        let mut ctx: ibv_context = Default::default();
        let mut pd = ibv_pd {
            context: &mut ctx,
            ..Default::default()
        };
        // SAFETY: a fake PD that lives for the call.
        let none = unsafe { ibv_alloc_mw(&mut pd, IBV_MW_TYPE_2) };
        assert!(none.is_null());
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(EOPNOTSUPP)
        );
        // SAFETY: the fake context, written through the pointer the PD holds.
        unsafe { (*pd.context).ops.alloc_mw = Some(alloc_mw) };
        // SAFETY: as above.
        let mw = unsafe { ibv_alloc_mw(&mut pd, IBV_MW_TYPE_2) };
        assert!(!mw.is_null());
        // SAFETY: the window just made.
        let (rkey, ty) = unsafe { ((*mw).rkey, (*mw).type_) };
        assert_eq!((ty, ibv_inc_rkey(rkey)), (IBV_MW_TYPE_2, 0x0004_0100));
        // SAFETY: as above; no op yet: nothing is freed.
        assert_eq!(unsafe { ibv_dealloc_mw(mw) }, ENOSYS);
        // SAFETY: as above.
        unsafe { (*pd.context).ops.dealloc_mw = Some(dealloc_mw) };
        // SAFETY: as above; freed once.
        assert_eq!(unsafe { ibv_dealloc_mw(mw) }, 0);
    }

    #[test]
    fn inc_rkey_steps_the_tag_byte_only() {
        assert_eq!(ibv_inc_rkey(0x1234_5600), 0x1234_5601);
        assert_eq!(ibv_inc_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(ibv_inc_rkey(u32::MAX), 0xffff_ff00);
        // The constants a bind and an invalidation use, as verbs.h numbers them.
        assert_eq!(
            (
                IBV_WR_LOCAL_INV,
                IBV_WR_BIND_MW,
                IBV_WC_BIND_MW,
                IBV_WC_LOCAL_INV
            ),
            (7, 8, 5, 6)
        );
        assert_eq!((IBV_ACCESS_MW_BIND, IBV_MW_TYPE_2), (16, 2));
        assert_eq!(
            (IBV_DEVICE_MEM_WINDOW_TYPE_2A, IBV_DEVICE_MEM_WINDOW_TYPE_2B),
            (1 << 23, 1 << 24)
        );
    }
}
