//! The POSIX path's configuration: chosen from the node's cores and the transfer's size, with
//! the environment's overrides, and checked against its bounds.

use super::sys::DIRECT_ALIGN;
use crate::error::{Error, Result};
use std::sync::OnceLock;

/// How the POSIX path splits and overlaps a transfer.
///
/// Unless set on the file
/// ([`GdsFile::set_posix_config`](crate::storage::GdsFile::set_posix_config)), each transfer
/// uses [`PosixConfig::automatic`]: chosen from the node's cores and the transfer's size, with
/// the overrides of the environment (see there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PosixConfig {
    /// Threads for reads through the page cache (the calling thread is one of them).
    pub threads: usize,
    /// Threads for `O_DIRECT` reads and writes (page-cache-cold reads, durable writes), which
    /// are bound by the device's queue rather than by memory copies.
    pub direct_threads: usize,
    /// Threads for writes through the page cache (the file system serializes them per file).
    pub write_threads: usize,
    /// Bytes per chunk (one `pread` or `pwrite` and one copy), except `O_DIRECT` reads.
    pub chunk: usize,
    /// Bytes per chunk of `O_DIRECT` reads (page-cache-cold reads): one request to the device
    /// per chunk.
    pub direct_read_chunk: usize,
    /// Chunks each thread keeps in flight (2 = double buffering).
    pub depth: usize,
}

impl Default for PosixConfig {
    /// [`for_node`](Self::for_node) for this node's cores and a large transfer.
    fn default() -> Self {
        PosixConfig::for_node(cores(), usize::MAX)
    }
}

/// The cores this process may run on (`available_parallelism`: affinity and cgroup quota),
/// at least 1.
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The environment variables that override the automatic configuration, with the field each
/// sets (chunks in KiB).
pub const POSIX_ENV: [&str; 6] = [
    "GPUDIRECT_POSIX_THREADS",
    "GPUDIRECT_POSIX_DIRECT_THREADS",
    "GPUDIRECT_POSIX_WRITE_THREADS",
    "GPUDIRECT_POSIX_CHUNK_KIB",
    "GPUDIRECT_POSIX_DEPTH",
    "GPUDIRECT_POSIX_DIRECT_READ_CHUNK_KIB",
];

impl PosixConfig {
    /// The most threads of each kind a configuration may ask for.
    pub const MAX_THREADS: usize = 256;
    /// The most chunks in flight per thread.
    pub const MAX_DEPTH: usize = 16;
    /// The largest chunk, in bytes (1 GiB).
    pub const MAX_CHUNK: usize = 1 << 30;
    /// The most pinned host memory one transfer's chunks may take, in bytes (64 GiB).
    pub const MAX_PINNED_BYTES: usize = 64 << 30;

    /// The configuration for a transfer of `len` bytes on a node with `cores` cores:
    ///
    /// - `threads`: `cores`, at most 16 (page-cache reads are memory copies, one per core; on a
    ///   32-core node hot reads peaked at 16 threads, and 32 were slower);
    /// - `direct_threads`: `cores / 8` between 4 and 8 (`O_DIRECT` requests wait on the device:
    ///   raw `O_DIRECT` reads peaked at 4 to 8 threads and fell off past them);
    /// - `write_threads`: 1 (buffered writes to one file are serialized by the file system);
    /// - `chunk`: 4 MiB (there, hot reads and cached writes ran faster than with 1 MiB chunks);
    ///   smaller, down to 256 KiB, while the transfer would give a thread fewer than two chunks;
    /// - `direct_read_chunk`: 1 MiB (cold reads, raw `O_DIRECT` and this path alike, ran faster
    ///   with 1 MiB requests than with 4 MiB), smaller in the same way as `chunk`;
    /// - `depth`: 2.
    ///
    /// `docs/storage.md` ("How the defaults were chosen") gives the measurements.
    ///
    /// A transfer uses no more threads than it has chunks.
    pub fn for_node(cores: usize, len: usize) -> PosixConfig {
        let cores = cores.max(1);
        let threads = cores.min(16);
        // Halved, down to 256 KiB, while `len` would give each of `threads` fewer than two.
        let fit = |mut chunk: usize, threads: usize| {
            while chunk > 256 << 10 && len / chunk < 2 * threads {
                chunk /= 2;
            }
            chunk
        };
        // O_DIRECT reads are bound by the device's queue: raw O_DIRECT reads peaked at 4-8
        // threads and fell off beyond (docs/storage.md).
        let direct_threads = (cores / 8).clamp(4, 8);
        PosixConfig {
            threads,
            direct_threads,
            write_threads: 1,
            chunk: fit(4 << 20, threads),
            direct_read_chunk: fit(1 << 20, direct_threads),
            depth: 2,
        }
    }

    /// The configuration a transfer of `len` bytes uses unless the file has its own:
    /// [`for_node`](Self::for_node) for this process's cores (`available_parallelism`), with
    /// any of these environment variables overriding its field ([`POSIX_ENV`], read once):
    /// `GPUDIRECT_POSIX_THREADS`, `GPUDIRECT_POSIX_DIRECT_THREADS`,
    /// `GPUDIRECT_POSIX_WRITE_THREADS`, `GPUDIRECT_POSIX_CHUNK_KIB` (the chunk in KiB),
    /// `GPUDIRECT_POSIX_DEPTH` and `GPUDIRECT_POSIX_DIRECT_READ_CHUNK_KIB`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the variable when one is not a whole number, or naming
    /// the field (`config.threads`, ...) when the result breaks a bound of
    /// [`validate`](Self::validate).
    pub fn automatic(len: usize) -> Result<PosixConfig> {
        static ENV: OnceLock<[Option<String>; 6]> = OnceLock::new();
        let env = ENV.get_or_init(|| POSIX_ENV.map(|k| std::env::var(k).ok()));
        with_overrides(PosixConfig::for_node(cores(), len), env)
    }

    /// Check the configuration: at least one thread of each kind and one chunk in flight; a
    /// chunk that is a non-zero multiple of [`DIRECT_ALIGN`]; every field within its bound
    /// ([`MAX_THREADS`](Self::MAX_THREADS), [`MAX_DEPTH`](Self::MAX_DEPTH),
    /// [`MAX_CHUNK`](Self::MAX_CHUNK)); and the chunks of the largest thread count within
    /// [`MAX_PINNED_BYTES`](Self::MAX_PINNED_BYTES). Every transfer checks it before anything
    /// else.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field and the rule.
    pub fn validate(&self) -> Result<()> {
        for (arg, v) in [
            ("config.threads", self.threads),
            ("config.direct_threads", self.direct_threads),
            ("config.write_threads", self.write_threads),
        ] {
            if v == 0 || v > Self::MAX_THREADS {
                return Err(Error::invalid(
                    arg,
                    v,
                    format!("must be between 1 and {}", Self::MAX_THREADS),
                ));
            }
        }
        if self.depth == 0 || self.depth > Self::MAX_DEPTH {
            return Err(Error::invalid(
                "config.depth",
                self.depth,
                format!("must be between 1 and {}", Self::MAX_DEPTH),
            ));
        }
        for (what, chunk) in [
            ("config.chunk", self.chunk),
            ("config.direct_read_chunk", self.direct_read_chunk),
        ] {
            if chunk == 0 || chunk > Self::MAX_CHUNK || !chunk.is_multiple_of(DIRECT_ALIGN) {
                return Err(Error::invalid(
                    what,
                    chunk,
                    format!(
                        "must be a non-zero multiple of {DIRECT_ALIGN} of at most {}",
                        Self::MAX_CHUNK
                    ),
                ));
            }
        }
        match self.pinned_bytes() {
            Some(n) if n <= Self::MAX_PINNED_BYTES => Ok(()),
            _ => Err(Error::invalid(
                "config",
                format!("{self:?}"),
                format!(
                    "threads x depth x bounce length must be at most {} bytes",
                    Self::MAX_PINNED_BYTES
                ),
            )),
        }
    }

    /// Bytes of each bounce chunk: the larger chunk plus room to align both ends for
    /// `O_DIRECT`.
    ///
    /// # Errors
    ///
    /// As [`validate`](Self::validate).
    pub fn bounce_len(&self) -> Result<usize> {
        self.validate()?;
        // Within bounds: both chunks are at most MAX_CHUNK.
        Ok(self.chunk.max(self.direct_read_chunk) + 2 * DIRECT_ALIGN)
    }

    /// The pinned bytes of the chunks when every thread of the largest count is busy, or `None`
    /// where that overflows.
    fn pinned_bytes(&self) -> Option<usize> {
        self.chunk
            .max(self.direct_read_chunk)
            .checked_add(2 * DIRECT_ALIGN)?
            .checked_mul(self.depth)?
            .checked_mul(
                self.threads
                    .max(self.direct_threads)
                    .max(self.write_threads),
            )
    }
}

/// `base` with the fields set by the environment values `env` (in [`POSIX_ENV`]'s order).
fn with_overrides(base: PosixConfig, env: &[Option<String>; 6]) -> Result<PosixConfig> {
    let mut cfg = base;
    for (i, v) in env.iter().enumerate() {
        let Some(v) = v else { continue };
        let n: usize = v.trim().parse().map_err(|_| {
            Error::invalid(
                POSIX_ENV[i],
                v,
                "must be a whole number (see PosixConfig::automatic)",
            )
        })?;
        let kib = || {
            n.checked_mul(1024)
                .ok_or_else(|| Error::invalid(POSIX_ENV[i], v, "the chunk in bytes overflows"))
        };
        match i {
            0 => cfg.threads = n,
            1 => cfg.direct_threads = n,
            2 => cfg.write_threads = n,
            3 => cfg.chunk = kib()?,
            4 => cfg.depth = n,
            _ => cfg.direct_read_chunk = kib()?,
        }
    }
    cfg.validate()?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::posix::testing::assert_invalid;

    #[test]
    fn the_node_sets_threads_and_chunks() {
        let big = PosixConfig::for_node(16, 1 << 30);
        assert_eq!(
            big,
            PosixConfig {
                threads: 16,
                direct_threads: 4,
                write_threads: 1,
                chunk: 4 << 20,
                direct_read_chunk: 1 << 20,
                depth: 2
            }
        );
        assert_eq!(PosixConfig::for_node(128, 1 << 30).threads, 16);
        assert_eq!(PosixConfig::for_node(8, 1 << 30).threads, 8);
        assert_eq!(PosixConfig::for_node(2, 1 << 30).direct_threads, 4);
        assert_eq!(PosixConfig::for_node(64, 1 << 30).direct_threads, 8);
        assert_eq!(PosixConfig::for_node(1000, 1 << 30).direct_threads, 8);
        assert_eq!(PosixConfig::for_node(0, 1 << 30).threads, 1);
        // Small transfers: smaller chunks (powers of two, so few pools), never below 256 KiB.
        assert_eq!(PosixConfig::for_node(16, 128 << 20).chunk, 4 << 20);
        assert_eq!(PosixConfig::for_node(16, 64 << 20).chunk, 2 << 20);
        assert_eq!(PosixConfig::for_node(16, 16 << 20).chunk, 512 << 10);
        assert_eq!(PosixConfig::for_node(16, 4096).chunk, 256 << 10);
        // O_DIRECT reads: 1 MiB, halved while each of the 4 direct threads would get fewer
        // than two.
        assert_eq!(
            PosixConfig::for_node(16, 8 << 20).direct_read_chunk,
            1 << 20
        );
        assert_eq!(
            PosixConfig::for_node(16, 4 << 20).direct_read_chunk,
            512 << 10
        );
        assert_eq!(PosixConfig::for_node(16, 4096).direct_read_chunk, 256 << 10);
        for cores in [0, 1, 2, 16, 32, 1000] {
            for len in [0, 1, 1 << 20, 1 << 30, usize::MAX] {
                PosixConfig::for_node(cores, len).validate().unwrap();
            }
        }
        PosixConfig::default().validate().unwrap();
    }

    #[test]
    fn environment_overrides_are_checked() {
        let base = PosixConfig::for_node(16, 1 << 30);
        let none: [Option<String>; 6] = Default::default();
        assert_eq!(with_overrides(base, &none).unwrap(), base);
        let some = [
            Some("4".into()),
            None,
            Some(" 2 ".into()),
            Some("2048".into()),
            Some("3".into()),
            Some("512".into()),
        ];
        let c = with_overrides(base, &some).unwrap();
        assert_eq!(
            (
                c.threads,
                c.direct_threads,
                c.write_threads,
                c.chunk,
                c.depth,
                c.direct_read_chunk
            ),
            (4, 4, 2, 2 << 20, 3, 512 << 10)
        );
        let mut bad: [Option<String>; 6] = Default::default();
        bad[3] = Some("lots".into());
        let e = with_overrides(base, &bad).unwrap_err();
        assert_invalid(&e, "GPUDIRECT_POSIX_CHUNK_KIB");
        bad[3] = Some(usize::MAX.to_string());
        assert!(with_overrides(base, &bad).is_err(), "overflowing chunk");
        bad[3] = None;
        bad[0] = Some("0".into());
        let e = with_overrides(base, &bad).unwrap_err();
        assert_invalid(&e, "config.threads");
        bad[0] = None;
        bad[5] = Some("3".into()); // 3 KiB: not a multiple of DIRECT_ALIGN
        let e = with_overrides(base, &bad).unwrap_err();
        assert_invalid(&e, "config.direct_read_chunk");
        bad[5] = Some(usize::MAX.to_string());
        assert!(
            with_overrides(base, &bad).is_err(),
            "overflowing direct read chunk"
        );
    }

    fn config() -> impl Strategy<Value = PosixConfig> {
        let size = || prop_oneof![any::<usize>(), 0usize..300, Just(usize::MAX)];
        let chunk = || {
            prop_oneof![
                any::<usize>(),
                (0usize..=(PosixConfig::MAX_CHUNK / DIRECT_ALIGN + 2))
                    .prop_map(|k| k * DIRECT_ALIGN),
                Just(usize::MAX - 4095),
            ]
        };
        (size(), size(), size(), chunk(), chunk(), size()).prop_map(
            |(threads, direct_threads, write_threads, chunk, direct_read_chunk, depth)| {
                PosixConfig {
                    threads,
                    direct_threads,
                    write_threads,
                    chunk,
                    direct_read_chunk,
                    depth,
                }
            },
        )
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn configs_are_bounded(cfg in config()) {
            let bounce = cfg.chunk.max(cfg.direct_read_chunk) as u128 + 2 * DIRECT_ALIGN as u128;
            let most = cfg.threads.max(cfg.direct_threads).max(cfg.write_threads) as u128;
            let pinned = bounce
                .checked_mul(cfg.depth as u128)
                .and_then(|b| b.checked_mul(most))
                .unwrap_or(u128::MAX);
            let t = 1..=PosixConfig::MAX_THREADS;
            let ok = t.contains(&cfg.threads)
                && t.contains(&cfg.direct_threads)
                && t.contains(&cfg.write_threads)
                && (1..=PosixConfig::MAX_DEPTH).contains(&cfg.depth)
                && [cfg.chunk, cfg.direct_read_chunk].iter().all(|&c| {
                    c > 0 && c <= PosixConfig::MAX_CHUNK && c % DIRECT_ALIGN == 0
                })
                && pinned <= PosixConfig::MAX_PINNED_BYTES as u128;
            prop_assert_eq!(cfg.validate().is_ok(), ok);
            match cfg.bounce_len() {
                Ok(b) => prop_assert!(
                    ok && b as u128 == bounce && b > cfg.chunk && b > cfg.direct_read_chunk
                ),
                Err(_) => prop_assert!(!ok),
            }
        }
    }
}
