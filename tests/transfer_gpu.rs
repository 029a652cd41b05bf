//! Tier 2 (a GPU node, no NIC needed): what the transfer engine's registration cache keys GPU
//! memory by. The cache tells allocations apart by the driver's buffer id
//! (`CU_POINTER_ATTRIBUTE_BUFFER_ID`), not by address: a view inside an allocation has the
//! allocation's id, and a new allocation at a freed allocation's address has a new one. Without a
//! GPU every test prints `SKIPPED` (a failure when `GPUDIRECT_REQUIRE` names `gpu`).
//!
//! (The staged path's GPU half, chunks through the bounce ring with exact bytes, is a unit test
//! of `gpudirect::transfer`: `staged_chunks_round_trip_through_the_copies_on_a_gpu`.)

use gpudirect::memory::{DeviceBuffer, DeviceMemory, pointer_attributes};
use gpudirect_testing::{Hardware, skip};

#[test]
fn buffer_ids_tell_allocations_apart_and_never_repeat() {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => return skip(Hardware::Gpu, e),
    };
    let a = DeviceBuffer::<u8>::alloc(&ctx, 1 << 20).unwrap();
    let b = DeviceBuffer::<u8>::alloc(&ctx, 1 << 20).unwrap();
    let ia = pointer_attributes(a.device_ptr()).unwrap();
    let ib = pointer_attributes(b.device_ptr()).unwrap();
    assert_ne!(ia.buffer_id, 0, "the driver gives every allocation an id");
    assert_ne!(ia.buffer_id, ib.buffer_id, "two allocations, two ids");
    // A view inside the allocation: the allocation's id (the cache reuses its registration).
    let inside = pointer_attributes(a.device_ptr() + 4096 + 17).unwrap();
    assert_eq!(inside.buffer_id, ia.buffer_id);
    assert_eq!(inside.range_start, a.device_ptr());
    // Free and allocate again, until the address comes back: a new id every time.
    let (addr, id) = (a.device_ptr(), ia.buffer_id);
    drop(a);
    let mut reused = false;
    let mut keep = Vec::new();
    for _ in 0..16 {
        let c = DeviceBuffer::<u8>::alloc(&ctx, 1 << 20).unwrap();
        let ic = pointer_attributes(c.device_ptr()).unwrap();
        assert_ne!(
            ic.buffer_id, id,
            "a new allocation never has a freed one's id"
        );
        assert_ne!(ic.buffer_id, ib.buffer_id);
        if c.device_ptr() == addr {
            reused = true;
            println!(
                "address {addr:#x} came back with id {} (was {id})",
                ic.buffer_id
            );
            break;
        }
        keep.push(c);
    }
    if !reused {
        println!(
            "the driver did not hand address {addr:#x} back in 16 allocations; ids checked anyway"
        );
    }
}

#[test]
fn vmm_chunks_are_reported_for_whole_registration() {
    use gpudirect::memory::VmmBuffer;
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => return skip(Hardware::Gpu, e),
    };
    // Two physical chunks mapped back to back: the layout the engine registers whole through
    // dma-buf, or refuses naming the chunk. Here, without a NIC, only the layout it sees.
    let g = match VmmBuffer::<u8>::granularity(&ctx) {
        Ok(g) => g,
        Err(e) => return skip(Hardware::Gpu, format!("VMM granularity: {e}")),
    };
    let v = VmmBuffer::<u8>::alloc_chunks(&ctx, &[g, g]).unwrap();
    let m = v.vmm_mappings().expect("a VMM buffer knows its mappings");
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].0, v.device_ptr());
    assert_eq!(m[1].0, v.device_ptr() + g as u64);
    let a0 = pointer_attributes(m[0].0).unwrap();
    let a1 = pointer_attributes(m[1].0).unwrap();
    println!(
        "chunk buffer ids {} and {}; ranges {:#x}+{} and {:#x}+{}",
        a0.buffer_id, a1.buffer_id, a0.range_start, a0.range_size, a1.range_start, a1.range_size
    );
    assert!(a0.gpu_direct_rdma_capable && a1.gpu_direct_rdma_capable);
}
