//! CUDA IPC: device memory and events shared with other processes (the usual
//! one-process-per-GPU layout).
//!
//! | memory kind | export | import | handle |
//! | --- | --- | --- | --- |
//! | `cuMemAlloc` ([`crate::memory::DeviceBuffer`]) | [`IpcExport::new`] (`cuIpcGetMemHandle`) | [`IpcMemory::open`] (`cuIpcOpenMemHandle`) | [`IpcMemHandle`], serde |
//! | VMM ([`crate::memory::VmmBuffer`]) | [`export_vmm`] (`cuMemExportToShareableHandle`, POSIX fd) | [`VmmImport::open`] (`cuMemImportFromShareableHandle`, `cuMemMap`) | [`VmmHandle`], serde, plus the fd sent with [`send_fd`] (SCM_RIGHTS) |
//! | pool memory from an [`IpcPool`] | [`PoolAlloc::export`] (`cuMemPoolExportPointer`) after [`IpcPool::export_fd`] | [`PoolImport::open`] (`cuMemPoolImportPointer`) after [`IpcPool::import`] | [`PoolPtrHandle`], serde, plus the pool's fd |
//! | events | [`IpcEvent::new`] (`cuIpcGetEventHandle`) | [`IpcEvent::open`] (`cuIpcOpenEventHandle`) | [`IpcEventHandle`], serde |
//!
//! Stream-ordered pool memory from the device's default pool (cudarc's `CudaSlice`) is not
//! exportable: [`IpcExport::new`] answers [`crate::Error::Unsupported`] for it, naming
//! `cuMemPoolExportPointer` and the exportable pool ([`IpcPool`]) to allocate from instead.
//!
//! Handles are plain data: send them out of band (a file, a socket, an RDMA exchange) as JSON or
//! any serde format. Imported mappings own their mapping; dropping one waits for the importing
//! device's work (`cuCtxSynchronize`) before unmapping, and data paths hold it in their
//! [`crate::memory::InFlight`] until their work completes.

mod event;
mod fd;
mod mem;
mod pool;
mod vmm;

pub use event::{IpcEvent, IpcEventHandle};
pub use fd::{recv_fd, send_fd};
pub use mem::{IpcExport, IpcMemHandle, IpcMemory};
pub use pool::{IpcPool, PoolAlloc, PoolImport, PoolPtrHandle};
pub use vmm::{VmmHandle, VmmImport, export_vmm};

/// 64 opaque handle bytes serialized as 128 lower-case hex digits.
pub(crate) mod hex64 {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    /// Serialize as hex.
    pub fn serialize<S: Serializer>(bytes: &[u8; 64], s: S) -> Result<S::Ok, S::Error> {
        let mut out = String::with_capacity(128);
        for b in bytes {
            out.push_str(&format!("{b:02x}"));
        }
        s.serialize_str(&out)
    }

    /// Parse 128 hex digits.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 64], D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(D::Error::custom)
    }

    pub(crate) fn parse(s: &str) -> Result<[u8; 64], String> {
        if s.len() != 128 || !s.is_ascii() {
            return Err(format!(
                "an IPC handle is 128 hex digits, got {} characters",
                s.len()
            ));
        }
        let mut out = [0u8; 64];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|e| format!("bad hex at {}: {e}", 2 * i))?;
        }
        Ok(out)
    }
}

/// The 64 handle bytes as unsigned bytes.
pub(crate) fn to_bytes(reserved: &[std::ffi::c_char; 64]) -> [u8; 64] {
    let mut out = [0u8; 64];
    for (o, &c) in out.iter_mut().zip(reserved) {
        *o = c as u8;
    }
    out
}

/// The 64 handle bytes as the C struct's `char` array.
pub(crate) fn to_chars(bytes: &[u8; 64]) -> [std::ffi::c_char; 64] {
    let mut out = [0 as std::ffi::c_char; 64];
    for (o, &b) in out.iter_mut().zip(bytes) {
        *o = b as std::ffi::c_char;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_bytes_round_trip_through_hex_and_chars() {
        let mut b = [0u8; 64];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37 + 200) as u8;
        }
        assert_eq!(to_bytes(&to_chars(&b)), b);
        let h = IpcMemHandle::from_parts(b, 40, 4096, 4, 0);
        let j = serde_json::to_string(&h).unwrap();
        let back: IpcMemHandle = serde_json::from_str(&j).unwrap();
        assert_eq!(back, h);
        assert!(hex64::parse("zz").is_err());
        let bad = j.replace(&format!("{:02x}", b[0]), "g0");
        assert!(serde_json::from_str::<IpcMemHandle>(&bad).is_err());
    }
}
