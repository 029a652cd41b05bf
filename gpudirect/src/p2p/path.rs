//! [`CopyPath`]: which path a copy really took.

/// Which path a copy took. Reported truthfully: a copy the driver stages is never called `Peer`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(tag = "path", rename_all = "snake_case"))]
#[non_exhaustive]
pub enum CopyPath {
    /// Source and destination on one device: `cuMemcpyDtoDAsync`.
    SameDevice,
    /// Device to device over an enabled peer mapping (NVLink or PCIe P2P): `cuMemcpyPeerAsync`
    /// between two devices, with every pool or VMM buffer involved granted to the other device;
    /// or a copy on one device's stream where a buffer is another device's memory mapped here
    /// (an import of another process's memory mapped away from the device it lives on).
    Peer,
    /// gpudirect's own pipeline through pinned host bounce chunks (two streams, pipelined chunks).
    Staged {
        /// Why: the driver's refusal (`CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`, ...) or `requested`.
        reason: Box<str>,
    },
    /// `cuMemcpyPeerAsync` between peers where a buffer lacks its own grant (pool memory without
    /// `cuMemPoolSetAccess`, VMM memory without `cuMemSetAccess`): the driver stages the copy
    /// internally, well below peer speed.
    DriverStaged {
        /// Which buffer lacks which grant.
        reason: Box<str>,
    },
}

impl CopyPath {
    /// A short name: `same_device`, `peer`, `staged`, `driver_staged`.
    pub fn name(&self) -> &'static str {
        match self {
            CopyPath::SameDevice => "same_device",
            CopyPath::Peer => "peer",
            CopyPath::Staged { .. } => "staged",
            CopyPath::DriverStaged { .. } => "driver_staged",
        }
    }
}

impl std::fmt::Display for CopyPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CopyPath::Staged { reason } | CopyPath::DriverStaged { reason } => {
                write!(f, "{} ({reason})", self.name())
            }
            _ => f.write_str(self.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_serializes_and_names() {
        let p = CopyPath::Staged {
            reason: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED".into(),
        };
        #[cfg(feature = "serde")]
        {
            let j = serde_json::to_string(&p).unwrap();
            assert_eq!(
                j,
                r#"{"path":"staged","reason":"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"}"#
            );
            assert_eq!(serde_json::from_str::<CopyPath>(&j).unwrap(), p);
        }
        assert_eq!(p.to_string(), "staged (CUDA_ERROR_PEER_ACCESS_UNSUPPORTED)");
        assert_eq!(CopyPath::Peer.to_string(), "peer");
    }
}
