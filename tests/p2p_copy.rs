//! Typed peer copies: every path with random data, poisoned destinations and exact bytes; the
//! path reported is the one that ran (the staged fallback where peer access is refused; pool memory
//! granted to the peer). docs/user-cases.md lists the cases.

mod support;

use gpudirect::memory::{DeviceBuffer, DeviceMemory, MemoryKind, PoolBuffer, VmmBuffer};
use gpudirect::p2p::{self, Copier, CopyOptions, CopyPath, PathChoice};
use gpudirect_testing::{Hardware, require, skip};
use support::gpu::{self, assert_same, poisoned, random_u32, stream};

/// An odd length: not a multiple of any chunk size, and more than one chunk.
const N: usize = (5 << 20) / 4 + 13;

fn staged() -> CopyOptions {
    CopyOptions {
        path: PathChoice::Staged,
        chunk_bytes: 1 << 20,
        slots: 3,
        ..Default::default()
    }
}

#[test]
fn same_device_copy_is_exact_and_says_so() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let data = random_u32(N, gpu::seed());
    let s = stream(0);
    let src = DeviceBuffer::from_slice(&s, &data).unwrap();
    let done = p2p::copy(src, poisoned(0, N)).unwrap();
    assert_eq!(done.path, CopyPath::SameDevice);
    assert_eq!(done.bytes, N * 4);
    assert_same(&done.dst.to_vec(&s).unwrap(), &data, "0->0 same device");
}

#[test]
fn staged_path_to_itself_is_exact() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let data = random_u32(N, gpu::seed());
    let s = stream(0);
    let copier = Copier::new(0, 0, staged()).unwrap();
    assert_eq!(
        copier.path(),
        &CopyPath::Staged {
            reason: "requested".into()
        }
    );
    // Blocking, then asynchronous through the same bounce buffers, twice in a row.
    let src = DeviceBuffer::from_slice(&s, &data).unwrap();
    let done = copier.copy(src, poisoned(0, N)).unwrap();
    assert_eq!(done.path.name(), "staged");
    assert_same(&done.dst.to_vec(&s).unwrap(), &data, "staged blocking");
    let (src, _) = done.into_parts();
    let op1 = copier.copy_async(src, poisoned(0, N)).unwrap();
    let data2 = random_u32(N, 99);
    let src2 = DeviceBuffer::from_slice(&s, &data2).unwrap();
    let op2 = copier.copy_async(src2, poisoned(0, N)).unwrap();
    let d1 = op1.wait().unwrap();
    let d2 = op2.wait().unwrap();
    assert_same(&d1.dst.to_vec(&s).unwrap(), &data, "staged async 1");
    assert_same(&d2.dst.to_vec(&s).unwrap(), &data2, "staged async 2");
}

#[test]
fn staged_path_handles_tiny_and_exact_chunk_sizes() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let s = stream(0);
    let copier = Copier::new(0, 0, staged()).unwrap();
    for n in [1usize, 255, (1 << 20) / 4, (3 << 20) / 4, (1 << 20) / 4 + 1] {
        let data = random_u32(n, n as u64);
        let src = DeviceBuffer::from_slice(&s, &data).unwrap();
        let done = copier.copy(src, poisoned(0, n)).unwrap();
        assert_same(&done.dst.to_vec(&s).unwrap(), &data, &format!("{n} words"));
    }
}

/// `n` random bytes from `seed`.
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    random_u32(n.div_ceil(4), seed)
        .into_iter()
        .flat_map(u32::to_le_bytes)
        .take(n)
        .collect()
}

/// Byte-sized staged copies at every size class: 1 byte, a page less one, a chunk less one, one
/// chunk, a chunk and one, and 64 MiB (many turns of the ring), with the test's small chunks and
/// with the default 8 MiB ones; device to itself and, with two GPUs, both ways between them.
/// Each destination starts as the complement of its source, so every byte not copied differs.
#[test]
fn staged_copies_are_exact_at_every_size() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    let seed = gpu::seed();
    let pairs: &[(usize, usize)] = if n > 1 {
        &[(0, 0), (0, 1), (1, 0)]
    } else {
        &[(0, 0)]
    };
    let default_staged = CopyOptions {
        path: PathChoice::Staged,
        ..Default::default()
    };
    for &(a, b) in pairs {
        let (sa, sb) = (stream(a), stream(b));
        for opts in [staged(), default_staged] {
            let copier = Copier::new(a, b, opts).unwrap();
            let chunk = opts.chunk_bytes;
            for bytes in [1, 4095, chunk - 1, chunk, chunk + 1, 64 << 20] {
                let data = random_bytes(bytes, seed ^ bytes as u64);
                let poison: Vec<u8> = data.iter().map(|b| !b).collect();
                let src = DeviceBuffer::from_slice(&sa, &data).unwrap();
                let dst = DeviceBuffer::from_slice(&sb, &poison).unwrap();
                let done = copier.copy(src, dst).unwrap();
                assert_eq!(done.path.name(), "staged");
                assert_eq!(done.bytes, bytes);
                let got = done.dst.to_vec(&sb).unwrap();
                if let Some(i) = got.iter().zip(&data).position(|(g, w)| g != w) {
                    panic!(
                        "{a}->{b}, chunk {chunk}, {bytes} bytes: first difference at byte {i}: \
                         got {:#04x}, want {:#04x}",
                        got[i], data[i]
                    );
                }
            }
            println!("{a}->{b} staged, {chunk}-byte chunks: every size exact");
        }
    }
    if n < 2 {
        skip(
            Hardware::MultiGpu,
            "staged copies between two GPUs need two; ran 0->0",
        );
    }
}

#[test]
fn pool_and_vmm_memory_copy_exactly() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let data = random_u32(N, gpu::seed());
    let s = stream(0);
    let ctx = gpudirect::cuda::context(0).unwrap();
    let slice = ctx.default_stream().clone_htod(&data).unwrap();
    let pool = PoolBuffer::new(slice).unwrap();
    assert_eq!(pool.kind(), MemoryKind::Pool);
    let vmm = VmmBuffer::<u32>::alloc(&ctx, N).unwrap();
    // pool -> vmm on one device, then vmm -> device through the staged path.
    let done = p2p::copy(pool, vmm).unwrap();
    assert_eq!(done.path, CopyPath::SameDevice);
    let (_, vmm) = done.into_parts();
    let done = Copier::new(0, 0, staged())
        .unwrap()
        .copy(vmm, poisoned(0, N))
        .unwrap();
    assert_same(
        &done.dst.to_vec(&s).unwrap(),
        &data,
        "pool -> vmm -> staged",
    );
}

#[test]
fn misuse_is_rejected_before_any_copy() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let s = stream(0);
    let src = DeviceBuffer::from_slice(&s, &[1u32, 2, 3]).unwrap();
    let e = p2p::copy(src, poisoned(0, 4)).unwrap_err();
    assert!(
        matches!(e, gpudirect::Error::InvalidArgument { arg: "dst", .. }),
        "{e}"
    );
    let ctx = gpudirect::cuda::context(0).unwrap();
    let host = gpudirect::memory::PinnedHostBuffer::<u32>::alloc(
        &ctx,
        3,
        gpudirect::memory::HostAllocFlags::empty(),
    )
    .unwrap();
    let e = p2p::copy(host, poisoned(0, 3)).unwrap_err();
    assert!(
        matches!(e, gpudirect::Error::InvalidArgument { arg: "src", .. }),
        "{e}"
    );
    // A buffer of device 0 handed to a copier from device 0 to device 0 is fine; one claiming
    // another device is refused (only checkable with two GPUs).
}

#[test]
fn every_ordered_pair_copies_exactly_on_the_true_path() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    let seed = gpu::seed();
    for a in 0..n {
        for b in 0..n {
            let data = random_u32(N, seed ^ (a * 31 + b) as u64);
            let sa = stream(a);
            let sb = stream(b);
            let src = DeviceBuffer::from_slice(&sa, &data).unwrap();
            let done = p2p::copy(src, poisoned(b, N)).unwrap();
            let can = a != b && p2p::can_access_peer(a, b).unwrap();
            let expected = if a == b {
                "same_device"
            } else if can {
                "peer"
            } else {
                "staged"
            };
            assert_eq!(done.path.name(), expected, "{a}->{b}: {}", done.path);
            assert_same(&done.dst.to_vec(&sb).unwrap(), &data, &format!("{a}->{b}"));
            println!("{a}->{b}: {} {:.1} GB/s", done.path, done.gb_per_s());
        }
    }
    if n < 2 {
        skip(
            Hardware::MultiGpu,
            "copies between two GPUs need two (one visible); ran 0->0",
        );
    }
}

#[test]
fn pool_memory_peer_copy_is_granted_and_reported() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    if n < 2 {
        skip(
            Hardware::MultiGpu,
            "the pool grant between GPUs needs two GPUs (one visible)",
        );
        return;
    }
    if !p2p::can_access_peer(0, 1).unwrap() {
        println!("0->1 has no P2P: pool grant not applicable");
        return;
    }
    let data = random_u32(N, gpu::seed());
    let ctx0 = gpudirect::cuda::context(0).unwrap();
    let ctx1 = gpudirect::cuda::context(1).unwrap();
    // Without the grant: the driver stages, and the report says so.
    let no_grant = CopyOptions {
        grant_access: false,
        ..Default::default()
    };
    let src = PoolBuffer::new(ctx0.default_stream().clone_htod(&data).unwrap()).unwrap();
    let dst = PoolBuffer::new(ctx1.default_stream().alloc_zeros::<u32>(N).unwrap()).unwrap();
    let done = Copier::new(0, 1, no_grant).unwrap().copy(src, dst).unwrap();
    println!("without grant: {} {:.1} GB/s", done.path, done.gb_per_s());
    assert_eq!(done.path.name(), "driver_staged");
    let (src, dst) = done.into_parts();
    let got = ctx1.default_stream().clone_dtoh(dst.as_slice()).unwrap();
    assert_same(&got, &data, "pool 0->1 without grant");
    // With the grant (the default): peer.
    let done = p2p::copy(src, dst).unwrap();
    println!("with grant: {} {:.1} GB/s", done.path, done.gb_per_s());
    assert_eq!(done.path, CopyPath::Peer);
}

#[test]
fn one_copier_shared_by_threads_keeps_every_copy_exact() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let copier = std::sync::Arc::new(Copier::new(0, 0, staged()).unwrap());
    let seed = gpu::seed();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let copier = copier.clone();
            std::thread::spawn(move || {
                let s = stream(0);
                for i in 0..3u64 {
                    let n = N - (t * 3 + i) as usize;
                    let data = random_u32(n, seed ^ (t << 8 | i));
                    let src = DeviceBuffer::from_slice(&s, &data).unwrap();
                    let done = copier
                        .copy_async(src, poisoned(0, n))
                        .unwrap()
                        .wait()
                        .unwrap();
                    assert_same(
                        &done.dst.to_vec(&s).unwrap(),
                        &data,
                        &format!("thread {t} copy {i}"),
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn dropping_an_in_flight_copy_waits_instead_of_freeing_early() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let s = stream(0);
    let copier = Copier::new(0, 0, staged()).unwrap();
    let data = random_u32(N, 3);
    // Dropped while (likely) still running: the drop waits for the event, then frees.
    drop(
        copier
            .copy_async(DeviceBuffer::from_slice(&s, &data).unwrap(), poisoned(0, N))
            .unwrap(),
    );
    // Forgotten: the buffers leak (safe), and the copier keeps working.
    std::mem::forget(
        copier
            .copy_async(DeviceBuffer::from_slice(&s, &data).unwrap(), poisoned(0, N))
            .unwrap(),
    );
    let done = copier
        .copy(DeviceBuffer::from_slice(&s, &data).unwrap(), poisoned(0, N))
        .unwrap();
    assert_same(
        &done.dst.to_vec(&s).unwrap(),
        &data,
        "after drop and forget",
    );
}

/// A VMM buffer of several physical chunks copied between two GPUs: every chunk is granted to the
/// peer, so the copy runs peer to peer over the whole range (or the true path is reported).
#[test]
fn a_vmm_buffer_of_several_chunks_copies_whole_between_gpus() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    if n < 2 {
        skip(
            Hardware::MultiGpu,
            "one GPU: the peer copy of a chunked VMM buffer needs two",
        );
        return;
    }
    let ctx0 = gpudirect::cuda::context(0).unwrap();
    let ctx1 = gpudirect::cuda::context(1).unwrap();
    let g = match VmmBuffer::<u32>::granularity(&ctx0) {
        Ok(g) => g,
        Err(e) => {
            skip(Hardware::Gpu, format!("no VMM: {e}"));
            return;
        }
    };
    let sizes = [g, 3 * g];
    let words = 4 * g / 4;
    let data = random_u32(words, gpu::seed());
    let mut src = VmmBuffer::<u32>::alloc_chunks(&ctx0, &sizes).unwrap();
    gpudirect::memory::copy_from_host(&stream(0), &data, &mut src).unwrap();
    let dst = VmmBuffer::<u32>::alloc_chunks(&ctx1, &sizes).unwrap();
    let done = p2p::copy(src, dst).unwrap();
    let can = p2p::can_access_peer(0, 1).unwrap();
    if can {
        assert_eq!(
            done.path,
            CopyPath::Peer,
            "every chunk granted: {}",
            done.path
        );
    }
    println!("chunked VMM 0 -> 1: {}", done.path);
    assert_same(
        &done.dst.to_vec(&stream(1)).unwrap(),
        &data,
        "chunked VMM peer copy",
    );
}

/// Whether device `peer` has read-write access to the VMM mapping at `base` (`cuMemGetAccess`).
fn has_access(base: u64, peer: i32) -> bool {
    use gpudirect::cudarc::driver::sys;
    // SAFETY: a plain C struct for which all-zero is valid; `id` is the C int at bytes 4..8 in
    // every binding version (the kind is the 4-byte field at offset 0).
    let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    // SAFETY: in bounds of the 8-byte struct, aligned for an i32.
    unsafe {
        (&raw mut location)
            .cast::<u8>()
            .add(4)
            .cast::<i32>()
            .write(peer)
    };
    let mut flags: u64 = 0;
    // SAFETY: valid pointers; the driver checks the address.
    let r = unsafe { sys::cuMemGetAccess(&mut flags, &location, base) };
    r == sys::CUresult::CUDA_SUCCESS
        && flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64
}

/// The public VMM grants on chunked buffers of device 1, with device 0's context current (where
/// `cuMemGetAddressRange` answered NOT_FOUND on the H200s): granting from the buffer's own layout
/// reaches every chunk, and a copier that only checks the grants then reports a peer copy.
#[test]
fn vmm_grants_follow_the_buffers_own_chunks() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    if n < 2 || !p2p::can_access_peer(0, 1).unwrap() || !p2p::can_access_peer(1, 0).unwrap() {
        skip(Hardware::MultiGpu, "needs two GPUs with peer access");
        return;
    }
    let ctx0 = gpudirect::cuda::context(0).unwrap();
    let ctx1 = gpudirect::cuda::context(1).unwrap();
    let g = match VmmBuffer::<u32>::granularity(&ctx1) {
        Ok(g) => g,
        Err(e) => {
            skip(Hardware::Gpu, format!("no VMM: {e}"));
            return;
        }
    };
    let dst = VmmBuffer::<u32>::alloc_chunks(&ctx1, &[g, 3 * g]).unwrap();
    let maps = dst.vmm_mappings().expect("a VmmBuffer knows its chunks");
    assert_eq!(maps.len(), 2);
    assert_eq!(maps[0], (dst.device_ptr(), g));
    assert_eq!(maps[1], (dst.device_ptr() + g as u64, 3 * g));
    ctx0.bind_to_thread().unwrap();
    assert!(maps.iter().all(|m| !has_access(m.0, 0)), "fresh chunks");
    assert!(p2p::grant_vmm_memory(&dst, 0).unwrap(), "granted now");
    assert!(
        maps.iter().all(|m| has_access(m.0, 0)),
        "every chunk granted"
    );
    ctx0.bind_to_thread().unwrap();
    assert!(!p2p::grant_vmm_memory(&dst, 0).unwrap(), "already granted");
    assert!(!p2p::grant_vmm_mapping(maps[1].0, maps[1].1, 0).unwrap());
    assert!(!p2p::grant_vmm_access(maps[1].0, 0).unwrap());

    // The address-only API looks the mapping up with the owner's context current: report what
    // the driver answers (a typed error naming the lookup when it cannot find the mapping).
    let other = VmmBuffer::<u32>::alloc_chunks(&ctx1, &[g, g]).unwrap();
    ctx0.bind_to_thread().unwrap();
    match p2p::grant_vmm_access(other.device_ptr(), 0) {
        Ok(granted) => {
            assert!(granted);
            assert!(has_access(other.device_ptr(), 0));
            println!("grant_vmm_access by address: found the mapping with the owner's context");
        }
        Err(e) => {
            assert!(e.to_string().contains("cuMemGetAddressRange_v2"), "{e}");
            println!("NOTE: grant_vmm_access by address: {e}");
        }
    }
    p2p::grant_vmm_memory(&other, 0).unwrap();
    let om = other.vmm_mappings().unwrap();
    assert!(om.iter().all(|m| has_access(m.0, 0)));

    // Copies that only check the grants see them (the source, shared through an Arc, forwards
    // its chunks too).
    let data = random_u32(4 * g / 4, gpu::seed());
    let mut src = VmmBuffer::<u32>::alloc_chunks(&ctx0, &[2 * g, g, g]).unwrap();
    gpudirect::memory::copy_from_host(&stream(0), &data, &mut src).unwrap();
    p2p::grant_vmm_memory(&src, 1).unwrap();
    let check_only = Copier::new(
        0,
        1,
        CopyOptions {
            grant_access: false,
            ..Default::default()
        },
    )
    .unwrap();
    let done = check_only.copy(std::sync::Arc::new(src), dst).unwrap();
    assert_eq!(done.path, CopyPath::Peer, "{}", done.path);
    assert_same(
        &done.dst.to_vec(&stream(1)).unwrap(),
        &data,
        "granted chunked VMM peer copy",
    );
}

/// 64 copies in flight through one copier (the pipelined pattern), then one wait each, in reverse
/// order: every destination holds exactly its own source. The copies share the copier's stream
/// fence (no event per copy): a wait that returned before its copy had run would show the poison.
#[test]
fn pipelined_copies_are_exact_on_every_path() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    let (a, b) = if n > 1 { (0, 1) } else { (0, 0) };
    let seed = gpu::seed();
    let (sa, sb) = (stream(a), stream(b));
    let words = 1024 + 7;
    for opts in [CopyOptions::default(), staged()] {
        let copier = Copier::new(a, b, opts).unwrap();
        let mut ops = Vec::new();
        let mut want = Vec::new();
        for i in 0..64u64 {
            let data = random_u32(words, seed ^ i);
            let src = DeviceBuffer::from_slice(&sa, &data).unwrap();
            ops.push(copier.copy_async(src, poisoned(b, words)).unwrap());
            want.push(data);
        }
        for (i, (op, data)) in ops.into_iter().zip(want).enumerate().rev() {
            let done = op.wait().unwrap();
            assert_eq!(&done.path, copier.path());
            assert_same(
                &done.dst.to_vec(&sb).unwrap(),
                &data,
                &format!("{a}->{b} {} copy {i}", copier.path()),
            );
        }
    }
    if n < 2 {
        skip(Hardware::MultiGpu, "ran 0->0 only (one GPU visible)");
    }
}

/// A scope's copies between borrowed buffers: 64 pairs of odd, varied lengths into poisoned
/// memory, each destination holding exactly its own source once `scope` returns (the one wait is
/// the scope's); bad pairs are refused before anything is queued and the rest still copy; a
/// panic in the closure is resumed only after the copies queued before it have completed.
#[test]
fn scoped_copies_between_borrowed_buffers_are_exact_on_every_path() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    let (a, b) = if n > 1 { (0, 1) } else { (0, 0) };
    let seed = gpu::seed() ^ 0x5C0E;
    let (sa, sb) = (stream(a), stream(b));
    for opts in [CopyOptions::default(), staged()] {
        let copier = Copier::new(a, b, opts).unwrap();
        let want: Vec<Vec<u32>> = (0..64u64)
            .map(|i| random_u32(1 + (i as usize * 977) % 5000, seed ^ i))
            .collect();
        let srcs: Vec<DeviceBuffer<u32>> = want
            .iter()
            .map(|d| DeviceBuffer::from_slice(&sa, d).unwrap())
            .collect();
        // Every destination holds exactly its own source.
        let exact = |dsts: &[DeviceBuffer<u32>], what: &str| {
            for (i, (dst, data)) in dsts.iter().zip(&want).enumerate() {
                assert_same(
                    &dst.to_vec(&sb).unwrap(),
                    data,
                    &format!("{a}->{b} {} scoped copy {i}{what}", copier.path()),
                );
            }
        };
        let mut dsts: Vec<DeviceBuffer<u32>> = want.iter().map(|d| poisoned(b, d.len())).collect();
        let mut short = poisoned(b, want[0].len() + 1);
        let mut elsewhere = poisoned(a, want[0].len());
        let refused = copier.scope(|s| {
            for (src, dst) in srcs.iter().zip(dsts.iter_mut()) {
                s.copy(src, dst).unwrap();
            }
            let short = s.copy(&srcs[0], &mut short).err().unwrap();
            let elsewhere = (a != b).then(|| s.copy(&srcs[0], &mut elsewhere).err().unwrap());
            (short, elsewhere)
        });
        assert!(
            matches!(
                refused.0,
                gpudirect::Error::InvalidArgument { arg: "dst", .. }
            ),
            "{}",
            refused.0
        );
        if let Some(e) = refused.1 {
            assert!(
                matches!(e, gpudirect::Error::InvalidArgument { arg: "dst", .. }),
                "{e}"
            );
        }
        exact(&dsts, "");
        assert_eq!(
            short.to_vec(&sb).unwrap(),
            vec![0xDEAD_BEEFu32; want[0].len() + 1]
        );
        // A scope that queues nothing (or only refused copies) returns its value, waiting for
        // nothing.
        assert_eq!(copier.scope(|_| 7), 7);
        assert!(copier.scope(|s| s.copy(&srcs[1], &mut short).is_err()));
        // A panic after the copies: resumed once they have completed.
        let mut again: Vec<DeviceBuffer<u32>> = want.iter().map(|d| poisoned(b, d.len())).collect();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            copier.scope(|s| {
                for (src, dst) in srcs.iter().zip(again.iter_mut()) {
                    s.copy(src, dst).unwrap();
                }
                panic!("after the copies");
            })
        }));
        assert!(caught.is_err());
        exact(&again, " before a panic");
    }
    if n < 2 {
        skip(Hardware::MultiGpu, "ran 0->0 only (one GPU visible)");
    }
}

/// A scope's wait while another thread captures a graph in global mode: the copy is exact and
/// the capture still gives its graph (the scope waits with its thread relaxed). Run in its own
/// process (`gpu::alone`): the capture would fail the tests beside it.
#[test]
fn a_scope_leaves_another_threads_global_capture_valid() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    if !gpu::alone("a_scope_leaves_another_threads_global_capture_valid") {
        return;
    }
    let (a, b) = if n > 1 { (0, 1) } else { (0, 0) };
    let data = random_u32(4096 + 3, gpu::seed() ^ 0xCA97);
    let (sa, sb) = (stream(a), stream(b));
    let copier = Copier::new(a, b, CopyOptions::default()).unwrap();
    let src = DeviceBuffer::from_slice(&sa, &data).unwrap();
    // Warmed first: the copier's stream has run work before the capture begins.
    let mut dst = poisoned(b, data.len());
    copier.scope(|s| s.copy(&src, &mut dst)).unwrap();
    let mut dst = poisoned(b, data.len());
    let ctx = gpudirect::cuda::context(a).unwrap();
    let (copied, captured) =
        gpu::during_a_global_capture(&ctx, || copier.scope(|s| s.copy(&src, &mut dst)));
    copied.unwrap();
    assert_eq!(captured, Ok(true), "the other thread's capture survived");
    assert_same(
        &dst.to_vec(&sb).unwrap(),
        &data,
        "scoped copy during a capture",
    );
}

/// Batches of copies (one `cuMemcpyBatchAsync` where the driver has it, one copy each on the
/// staged path): 64 pairs of odd, varied lengths into poisoned memory, every destination holding
/// exactly its own source; an empty batch and a bad pair (named by index) are refused before
/// anything is queued.
#[test]
fn batched_copies_are_exact_on_every_path() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    let (a, b) = if n > 1 { (0, 1) } else { (0, 0) };
    let seed = gpu::seed() ^ 0xBA7C;
    let (sa, sb) = (stream(a), stream(b));
    for opts in [CopyOptions::default(), staged()] {
        let copier = Copier::new(a, b, opts).unwrap();
        let mut pairs = Vec::new();
        let mut want = Vec::new();
        for i in 0..64u64 {
            let words = 1 + (i as usize * 977) % 5000;
            let data = random_u32(words, seed ^ i);
            pairs.push((
                DeviceBuffer::from_slice(&sa, &data).unwrap(),
                poisoned(b, words),
            ));
            want.push(data);
        }
        let done = copier.copy_batch_async(pairs).unwrap().wait().unwrap();
        assert_eq!(done.len(), 64);
        for (i, (c, data)) in done.iter().zip(&want).enumerate() {
            assert_eq!(&c.path, copier.path());
            assert_eq!(c.bytes, data.len() * 4);
            assert_same(
                &c.dst.to_vec(&sb).unwrap(),
                data,
                &format!("{a}->{b} {} batch pair {i}", copier.path()),
            );
        }
        let empty: Vec<(DeviceBuffer<u32>, DeviceBuffer<u32>)> = Vec::new();
        let e = copier.copy_batch_async(empty).err().unwrap();
        assert!(
            matches!(e, gpudirect::Error::InvalidArgument { arg: "pairs", .. }),
            "{e}"
        );
        let src = DeviceBuffer::from_slice(&sa, &want[0]).unwrap();
        let bad = vec![
            (src, poisoned(b, want[0].len())),
            (
                DeviceBuffer::from_slice(&sa, &want[1]).unwrap(),
                poisoned(b, want[1].len() + 1),
            ),
        ];
        let e = copier.copy_batch_async(bad).err().unwrap();
        assert!(
            matches!(&e, gpudirect::Error::InvalidArgument { arg: "pairs", value, .. } if value == "1"),
            "names pair 1: {e}"
        );
    }
    if n < 2 {
        skip(Hardware::MultiGpu, "ran 0->0 only (one GPU visible)");
    }
}

/// One copier on the peer (or same-device) path shared by four threads, each issuing and
/// waiting: nothing is locked on that path, and every copy stays exact.
#[test]
fn one_copier_on_the_direct_path_shared_by_threads() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    let (a, b) = if n > 1 { (0, 1) } else { (0, 0) };
    let copier = std::sync::Arc::new(Copier::new(a, b, CopyOptions::default()).unwrap());
    let seed = gpu::seed();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let copier = copier.clone();
            std::thread::spawn(move || {
                let (sa, sb) = (stream(a), stream(b));
                for i in 0..16u64 {
                    let words = 4096 + (t * 16 + i) as usize;
                    let data = random_u32(words, seed ^ (t << 8 | i));
                    let src = DeviceBuffer::from_slice(&sa, &data).unwrap();
                    let done = copier.copy(src, poisoned(b, words)).unwrap();
                    assert_same(
                        &done.dst.to_vec(&sb).unwrap(),
                        &data,
                        &format!("thread {t} copy {i}"),
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}
