//! The engine: the rails' devices and protection domains, the registration cache, and the
//! settings every endpoint of it uses.

use super::auth::{AuthKey, LocalPeers};
use super::descriptor::MAX_RAILS;
use super::membership::Roster;
use super::plan::preferred_rails;
use super::region::{Cache, CacheStats};
use crate::error::{Error, Result};
use crate::rdma::{AccessFlags, Context, DeviceList, ProtectionDomain};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How an [`Engine`] is set up. `Default` gives the values documented on each field.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineConfig {
    /// The verbs devices of the rails, in rail order (at most 16). Empty (the default): every
    /// verbs device, sorted by name; or with [`gpu`](Self::gpu), the NICs nearest that GPU
    /// first. Memory is registered on every one of them.
    pub devices: Vec<String>,
    /// The GPU whose nearest NICs come first (`topology::Placement::nearest_nics`) when
    /// `devices` is empty. Whatever the order, transfers of GPU memory prefer the rails nearest
    /// the memory's GPU.
    pub gpu: Option<usize>,
    /// Send-queue depth of each rail's queue pair (default 256, 2 to 32768): the most messages a
    /// rail has outstanding.
    pub queue_depth: u32,
    /// Receives posted for notifications on each rail (default 64, 4 to 4096).
    pub notify_depth: u32,
    /// The largest message in bytes (default 1 MiB, 4 KiB to 1 GiB); lowered to the port's
    /// `max_msg_sz`.
    pub max_message: u32,
    /// Requests of at least this many bytes are striped over the rails (default 512 KiB).
    pub stripe_min: u64,
    /// Bound on [`Engine::connect`] as a whole (every rail's connection and handshake), and on
    /// an intra-node meeting (default 10 s; 1 ms to 1 h). A listener's handshakes have their
    /// own bound, [`handshake_timeout`](Self::handshake_timeout).
    pub connect_timeout: Duration,
    /// The rails' local ACK timeout exponent (`None`, the default: rdma_cm's, about a second a
    /// try on RoCE, retried 7 times, which rxe takes as without end; else 1 to 31): a message
    /// unacknowledged for 4.096 µs × 2^t is sent again, up to 6 times, and then fails its rail,
    /// whose messages move to the rails left. Shorter finds a dead link sooner; too short
    /// fails a rail that is only slow.
    pub ack_timeout: Option<u8>,
    /// A transfer's deadline when its options give none (default 30 s; above 0).
    pub deadline: Duration,
    /// How long a thread waiting for a request ([`Transfer::wait`](super::Transfer::wait)) or
    /// a notification ([`Endpoint::next_notification`](super::Endpoint::next_notification))
    /// looks for it itself before it sleeps until the progress thread wakes it (default 10 ms,
    /// as the intra-node path's waits). Across nodes it polls the completion queues meanwhile
    /// (one waiting thread at a time): no thread hand-off for what comes soon, at the cost of a
    /// CPU while it lasts (at most 1 s). 0: the progress thread sees every completion and
    /// wakes the waiter.
    pub spin: Duration,
    /// Whether GPU memory that cannot be registered with the NIC (pool memory; no dma-buf and
    /// no nvidia-peermem) moves through pinned host bounce buffers (default `true`); `false`
    /// refuses it at registration.
    pub staging: bool,
    /// Bytes of one staging chunk (default 1 MiB, 4 KiB to 1 GiB).
    pub staging_chunk: usize,
    /// Staging chunks in flight per transfer (default 4, 2 to 64: one copied while another is
    /// on the wire).
    pub staging_slots: usize,
    /// No verbs rails (default `false`): the engine never loads libibverbs, registers memory
    /// with no NIC and makes only intra-node endpoints ([`Engine::connect_local`],
    /// [`Engine::listen_local`]); `devices` must then be empty. [`EngineConfig::local`] sets it.
    pub local_only: bool,
    /// CUDA streams per local GPU that an intra-node endpoint copies on (default 1, at most
    /// 16). With more than one, each copy of at least [`copy_chunk`](Self::copy_chunk) bytes
    /// is cut into chunks spread over the streams; the request is done when every stream is.
    pub copy_streams: usize,
    /// Bytes of one chunk when [`copy_streams`](Self::copy_streams) is above 1 (default 16 MiB,
    /// at least 64 KiB).
    pub copy_chunk: usize,
    /// Issue lanes of an intra-node endpoint (default 4, 1 to 64). Each thread that submits
    /// requests on an endpoint issues on one of its lanes (given in turn as threads first
    /// submit there, then always the same), with the lane's own streams and lock, so that
    /// threads submitting on one endpoint queue their copies side by side. A lane's requests
    /// finish in the order they were made; a request with a notification finishes only once
    /// every request the endpoint queued before it has, so notifications leave in request order
    /// and each tells the peer that every earlier request's bytes are there too. Requests of
    /// different lanes are otherwise not ordered: a read of what another thread's write (not
    /// waited for) puts there may run first. With 1, every request of the endpoint is queued
    /// on one set of streams and finishes in request order.
    pub copy_lanes: usize,
    /// Whether a stream-ordered intra-node request of one pair
    /// ([`Endpoint::write_on`](super::Endpoint::write_on), `read_on`) whose ends are 16-byte
    /// aligned and on the stream's GPU is copied by a kernel that then stores the request's
    /// trigger word: one launch where copy-engine copies take a copy and a trigger write, so
    /// less host time per request (`docs/transfer.md` has the figures; default `false`: every
    /// copy on the copy engines). The kernel needs a free block slot on the GPU's multiprocessors: a kernel
    /// that fills them and spins on a completion word ([`StreamTransfer::completion_word`](super::StreamTransfer::completion_word),
    /// [`StreamWord`](super::StreamWord)) until such a request is done waits until the
    /// request's trigger deadline fails it, where copy engines would have made progress.
    ///
    /// With it, an intra-node request of at most 64 MiB whose pieces are 16-byte aligned, at
    /// most 2 MiB each and on its lane's one stream of the local memory's GPU is copied by a
    /// gather kernel, up to 32 pieces a launch, instead of a copy-engine submission per piece.
    /// Made while that lane is busy, such a request of at most 2 MiB waits to go in one launch
    /// with the lane's next ones; they go when one of the lane's requests is waited for or
    /// polled, when the lane's worker looks, or when a request that cannot wait is made
    /// (`docs/transfer.md`, "Gathered requests"). A launch needs a free block slot too: a
    /// kernel that fills the multiprocessors and spins until such a request's bytes arrive
    /// waits until the request's deadline fails it. A failed launch of waiting requests ends
    /// them with the driver's error, nothing queued for them, and fails the endpoint (their
    /// callers were told they were made: a later notification must not vouch for them).
    pub copy_kernel: bool,
    /// Whether an intra-node request's small copies are gathered on the copy engines through a
    /// CUDA graph (default `true`; ignored with [`copy_kernel`](Self::copy_kernel), which
    /// gathers them in its own launches).
    ///
    /// With it, a request of at most 64 MiB on its lane's one stream of the local memory's GPU
    /// goes as launches of a graph of up to 32 copy nodes (`cuGraphLaunch`, each node's
    /// operands set with `cuGraphExecMemcpyNodeSetParams`) where it took a copy-engine
    /// submission per piece (a launch, operands set, costs the caller less than one
    /// submission, also for one piece); made while that lane is busy, such a request of at most
    /// 2 MiB waits to go in one launch with the lane's next ones, as with the copy kernel
    /// (`docs/transfer.md`, "Gathered requests"). The copies run on the copy engines, whatever
    /// the multiprocessors do. The pieces of one launch run in no order among themselves;
    /// requests whose pieces share a byte one of them writes go in order.
    pub copy_graphs: bool,
    /// The key every endpoint's peer must prove it holds, on each rail (or on the socket inside
    /// a node) before either side publishes anything (default `None`: peers are not
    /// authenticated). Both sides need the same key: a key on one side only is refused on
    /// both, with [`Error::Authentication`]. See `docs/security.md`.
    pub key: Option<AuthKey>,
    /// The users an intra-node peer may run as (default [`LocalPeers::SameUser`]), checked on
    /// both sides from `SO_PEERCRED` before anything else.
    pub local_peers: LocalPeers,
    /// The most handshakes a listener runs at once, from rdma_cm's connection request to the
    /// peer's descriptors (default 64, 1 to 4096). When a new request finds them all running,
    /// the oldest one not authenticated yet is ended to make room (counted in
    /// [`ListenerStats::dropped`](super::ListenerStats::dropped)); when all are authenticated,
    /// the request is turned away.
    pub max_pending: usize,
    /// Bound on one handshake at a listener, from the connection request on (default 5 s, 1 ms
    /// to 10 min): a peer that is silent or slow holds its queue pair no longer.
    pub handshake_timeout: Duration,
    /// What a peer's descriptors let it reach (default [`PeerAccess::Auto`]): windows bound to
    /// that peer's queue pairs, or the regions' own rkeys. See `docs/security.md`.
    pub peer_access: PeerAccess,
    /// How often an endpoint this side connected tries to take its failed rails back
    /// ([`Endpoint::restore_rails`](super::Endpoint::restore_rails), on a thread of its own,
    /// the first try this long after a rail failed; default 1 s, 10 ms to 1 h). `None`: only
    /// when the application calls it.
    pub rail_retry: Option<Duration>,
}

/// How the descriptors an endpoint's peer receives at connect give it access to the published
/// memory ([`EngineConfig::peer_access`], [`Endpoint::peer_access`](super::Endpoint::peer_access)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PeerAccess {
    /// Windows where [`Windows`](Self::Windows) is possible (every device of the engine has
    /// type 2 memory windows, and no two rails of the endpoint go through one device), else
    /// [`Regions`](Self::Regions).
    #[default]
    Auto,
    /// Each descriptor published to a peer carries the rkey of a type 2 memory window bound at
    /// connect through that peer's queue pair only, over the descriptor's range; the windows are
    /// deallocated (their rkeys refused from then on) when the endpoint closes or breaks. Each
    /// rail binds its own windows, and its descriptors carry them as the rkey of its device.
    /// [`Engine::new`](super::Engine::new) refuses a device without type 2 windows, and the
    /// handshake refuses an endpoint two of whose rails go through one device of this engine
    /// ([`Error::Unsupported`](crate::Error::Unsupported) naming it).
    Windows,
    /// Each descriptor carries the regions' rkeys, shared by every peer and good until the
    /// region is deregistered.
    Regions,
}

impl std::fmt::Display for PeerAccess {
    /// `auto`, `per-peer memory windows`, `region rkeys`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerAccess::Auto => "auto",
            PeerAccess::Windows => "per-peer memory windows",
            PeerAccess::Regions => "region rkeys",
        })
    }
}

/// Whether an endpoint whose rails go through the engine devices `rails` (by name, in rail
/// order) gets windows, under `policy` on an engine whose devices all have type 2 windows
/// (`windows`). A descriptor has one rkey per device and a window works through one queue pair
/// only: two rails through one device cannot each have their own window under that rkey.
///
/// # Errors
///
/// [`Error::Unsupported`] under [`PeerAccess::Windows`] when the engine's devices lack windows
/// or two rails go through one device (named).
pub(crate) fn endpoint_access(
    policy: PeerAccess,
    windows: bool,
    rails: &[&str],
) -> Result<PeerAccess> {
    let shared = rails
        .iter()
        .enumerate()
        .find_map(|(i, d)| rails[..i].contains(d).then_some(*d));
    match policy {
        PeerAccess::Regions => Ok(PeerAccess::Regions),
        PeerAccess::Auto if windows && shared.is_none() => Ok(PeerAccess::Windows),
        PeerAccess::Auto => Ok(PeerAccess::Regions),
        PeerAccess::Windows if !windows => Err(Error::Unsupported {
            what: "per-peer memory windows (EngineConfig::peer_access = Windows)".into(),
            reason: "a device of the engine has no type 2 memory windows".into(),
        }),
        PeerAccess::Windows => match shared {
            Some(d) => Err(Error::Unsupported {
                what: "per-peer memory windows (EngineConfig::peer_access = Windows)".into(),
                reason: format!(
                    "two rails of the endpoint go through device {d} (rails {rails:?}): its one \
                     rkey per descriptor cannot name a window on each"
                ),
            }),
            None => Ok(PeerAccess::Windows),
        },
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            devices: Vec::new(),
            gpu: None,
            queue_depth: 256,
            notify_depth: 64,
            max_message: 1 << 20,
            stripe_min: 512 << 10,
            connect_timeout: Duration::from_secs(10),
            ack_timeout: None,
            deadline: Duration::from_secs(30),
            spin: Duration::from_millis(10),
            staging: true,
            staging_chunk: 1 << 20,
            staging_slots: 4,
            local_only: false,
            copy_streams: 1,
            copy_chunk: 16 << 20,
            copy_lanes: 4,
            copy_kernel: false,
            copy_graphs: true,
            key: None,
            local_peers: LocalPeers::SameUser,
            max_pending: 64,
            handshake_timeout: Duration::from_secs(5),
            peer_access: PeerAccess::Auto,
            rail_retry: Some(Duration::from_secs(1)),
        }
    }
}

impl EngineConfig {
    /// The default settings on these devices (rail order).
    pub fn with_devices<S: AsRef<str>>(devices: &[S]) -> Self {
        EngineConfig {
            devices: devices.iter().map(|d| d.as_ref().to_string()).collect(),
            ..Default::default()
        }
    }

    /// The default settings for an engine without rails: intra-node endpoints only, no verbs
    /// library loaded ([`local_only`](Self::local_only)).
    pub fn local() -> Self {
        EngineConfig {
            local_only: true,
            ..Default::default()
        }
    }

    /// Check the settings' ranges.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub fn check(&self) -> Result<()> {
        let bad = |arg, v: String, rule: &str| Err(Error::invalid(arg, v, rule));
        if self.devices.len() > MAX_RAILS {
            return bad(
                "devices",
                self.devices.len().to_string(),
                "at most 16 rails",
            );
        }
        if !(2..=1 << 15).contains(&self.queue_depth) {
            return bad(
                "queue_depth",
                self.queue_depth.to_string(),
                "2 to 32768 messages",
            );
        }
        if let Some(t) = self.ack_timeout
            && !(1..=31).contains(&t)
        {
            return bad(
                "ack_timeout",
                t.to_string(),
                "the ACK timeout exponent is 1 to 31",
            );
        }
        if !(4..=4096).contains(&self.notify_depth) {
            return bad(
                "notify_depth",
                self.notify_depth.to_string(),
                "4 to 4096 receives",
            );
        }
        if self.max_message < 4096 || self.max_message > 1 << 30 {
            return bad(
                "max_message",
                self.max_message.to_string(),
                "4 KiB to 1 GiB",
            );
        }
        if self.staging_slots < 2 || self.staging_slots > 64 {
            return bad(
                "staging_slots",
                self.staging_slots.to_string(),
                "2 to 64 chunks",
            );
        }
        if self.staging_chunk < 4096 || self.staging_chunk > 1 << 30 {
            return bad(
                "staging_chunk",
                self.staging_chunk.to_string(),
                "4 KiB to 1 GiB",
            );
        }
        if self.local_only && !self.devices.is_empty() {
            return bad(
                "devices",
                self.devices.len().to_string(),
                "an engine without rails (local_only) names no devices",
            );
        }
        if !(1..=16).contains(&self.copy_streams) {
            return bad(
                "copy_streams",
                self.copy_streams.to_string(),
                "1 to 16 streams",
            );
        }
        if self.copy_chunk < 64 << 10 {
            return bad("copy_chunk", self.copy_chunk.to_string(), "at least 64 KiB");
        }
        if !(1..=64).contains(&self.copy_lanes) {
            return bad("copy_lanes", self.copy_lanes.to_string(), "1 to 64 lanes");
        }
        if let Some(t) = self.rail_retry
            && !(Duration::from_millis(10)..=Duration::from_secs(3600)).contains(&t)
        {
            return bad("rail_retry", format!("{t:?}"), "10 ms to 1 h");
        }
        if !(1..=4096).contains(&self.max_pending) {
            return bad(
                "max_pending",
                self.max_pending.to_string(),
                "1 to 4096 handshakes",
            );
        }
        if !(Duration::from_millis(1)..=Duration::from_secs(600)).contains(&self.handshake_timeout)
        {
            return bad(
                "handshake_timeout",
                format!("{:?}", self.handshake_timeout),
                "1 ms to 10 minutes",
            );
        }
        if !(Duration::from_millis(1)..=Duration::from_secs(3600)).contains(&self.connect_timeout) {
            return bad(
                "connect_timeout",
                format!("{:?}", self.connect_timeout),
                "1 ms to 1 h",
            );
        }
        if self.deadline.is_zero() {
            return bad(
                "deadline",
                format!("{:?}", self.deadline),
                "above 0 (a request without its own deadline would end at once)",
            );
        }
        if self.spin > Duration::from_secs(1) {
            return bad(
                "spin",
                format!("{:?}", self.spin),
                "at most 1 s (a waiting thread polls for that long)",
            );
        }
        if self.local_only && self.peer_access == PeerAccess::Windows {
            return bad(
                "peer_access",
                "Windows".into(),
                "an engine without rails (local_only) binds no memory windows",
            );
        }
        if self.staging_chunk.checked_mul(self.staging_slots).is_none() {
            return bad(
                "staging_chunk",
                self.staging_chunk.to_string(),
                "chunk times slots overflows",
            );
        }
        Ok(())
    }
}

/// One rail's device: its context and protection domain (every registration lives here).
pub(crate) struct RailDevice {
    pub(crate) name: String,
    pub(crate) ctx: Context,
    pub(crate) pd: ProtectionDomain,
    /// The port's largest message.
    pub(crate) max_msg: u32,
    /// Whether it has type 2 memory windows.
    pub(crate) windows: bool,
}

/// Memory windows bound and revoked for peers, over the engine's life.
#[derive(Debug, Default)]
pub(crate) struct WindowCounts {
    pub(crate) bound: AtomicU64,
    pub(crate) revoked: AtomicU64,
}

/// Per-peer memory windows of an engine's endpoints so far ([`Engine::window_stats`](super::Engine::window_stats)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct WindowStats {
    /// Windows bound at connect, one per descriptor published to a peer.
    pub bound: u64,
    /// Windows deallocated (their rkeys refused from then on) as their endpoint closed or broke.
    pub revoked: u64,
}

pub(crate) struct EngineInner {
    pub(crate) config: EngineConfig,
    pub(crate) devices: Vec<RailDevice>,
    pub(crate) cache: Mutex<Cache>,
    pub(crate) stats: CacheStats,
    /// Preferred devices per GPU ordinal, computed once.
    prefer: Mutex<HashMap<usize, Vec<usize>>>,
    /// GPUs whose memory this engine registered for peers to write: flushed before a
    /// notification is delivered.
    gpu_targets: Mutex<Vec<usize>>,
    /// This engine among the process's engines (never reused): what its registrations carry.
    pub(crate) engine_id: u64,
    /// Its metadata store, published name and named peers (`transfer::membership`).
    pub(crate) roster: Roster,
    /// Whether endpoints may get per-peer windows: every device has them and the policy allows.
    pub(crate) windows: bool,
    pub(crate) window_counts: WindowCounts,
}

/// Engines made so far in the process.
static ENGINES: AtomicU64 = AtomicU64::new(1);

impl EngineInner {
    /// The largest message on every rail.
    pub(crate) fn max_message(&self) -> u32 {
        self.devices
            .iter()
            .map(|d| d.max_msg)
            .fold(self.config.max_message, u32::min)
    }

    /// Engine devices nearest GPU `ordinal` (every device when that cannot be told).
    pub(crate) fn preferred_for(&self, ordinal: Option<usize>) -> Vec<usize> {
        let all = || (0..self.devices.len()).collect();
        let Some(o) = ordinal else { return all() };
        let mut m = self.prefer.lock().unwrap_or_else(|e| e.into_inner());
        m.entry(o)
            .or_insert_with(|| match crate::topology::Placement::of_gpu(o) {
                Ok(p) => {
                    let aff: Vec<_> = self
                        .devices
                        .iter()
                        .map(|d| p.nic(&d.name).affinity)
                        .collect();
                    preferred_rails(&aff)
                }
                Err(_) => all(),
            })
            .clone()
    }

    /// GPUs whose memory peers may have written (see `gpu_targets`).
    pub(crate) fn gpu_targets(&self) -> Vec<usize> {
        self.gpu_targets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Note that GPU `ordinal` has memory registered for peers.
    pub(crate) fn add_gpu_target(&self, ordinal: usize) {
        let mut v = self.gpu_targets.lock().unwrap_or_else(|e| e.into_inner());
        if !v.contains(&ordinal) {
            v.push(ordinal);
        }
    }

    /// Refuse across-node endpoints on an engine without rails.
    pub(crate) fn require_rails(&self) -> Result<()> {
        if self.devices.is_empty() {
            return Err(Error::invalid(
                "engine",
                "no rails",
                "an engine without rails (EngineConfig::local) makes only intra-node endpoints: \
                 Engine::connect_local / listen_local",
            ));
        }
        Ok(())
    }

    /// What an endpoint of `rails` rails gives its peer ([`endpoint_access`]).
    pub(crate) fn peer_access(&self, rails: &[usize]) -> Result<PeerAccess> {
        let names: Vec<&str> = rails
            .iter()
            .map(|&d| self.devices[d].name.as_str())
            .collect();
        endpoint_access(self.config.peer_access, self.windows, &names)
    }

    /// What every registration allows: the NIC writes it for local requests; with
    /// [`PeerAccess::Windows`] peers reach it only through windows (`MW_BIND`, no remote
    /// access: a region's own rkey reaches nothing); otherwise remote read and write under the
    /// region's rkey, and `MW_BIND` too where windows may be bound.
    pub(crate) fn access(&self) -> AccessFlags {
        let remote = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        match (self.windows, self.config.peer_access) {
            (true, PeerAccess::Windows) => AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
            (true, _) => AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND | remote,
            (false, _) => AccessFlags::LOCAL_WRITE | remote,
        }
    }

    pub(crate) fn device_index(&self, name: &str) -> Option<usize> {
        self.devices.iter().position(|d| d.name == name)
    }
}

/// A transfer engine: the rails (verbs devices, each with its protection domain), the
/// registration cache, and the settings of its endpoints. Cheap to clone.
///
/// ```no_run
/// use gpudirect::transfer::{Buffer, Engine, EngineConfig};
/// # fn main() -> gpudirect::Result<()> {
/// let engine = Engine::new(EngineConfig::with_devices(&["mlx5_0", "mlx5_1"]))?;
/// let region = engine.register(Buffer::host(vec![0u8; 1 << 20])?)?;
/// let desc = region.descriptor()?; // for the peer
/// # let _ = desc;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Engine {
    pub(crate) inner: Arc<EngineInner>,
}

/// Open the rails' devices (none for a local-only engine) and make the engine.
///
/// # Errors
///
/// As [`Engine::new`].
pub(crate) fn open(config: EngineConfig) -> Result<Engine> {
    config.check()?;
    if config.local_only {
        return Ok(with_rails(config, Vec::new()));
    }
    let list = DeviceList::non_empty()?;
    let mut names = config.devices.clone();
    if names.is_empty() {
        let mut all: Vec<String> = list.iter().map(|d| d.name()).collect();
        all.sort();
        if let Some(g) = config.gpu
            && let Ok(p) = crate::topology::Placement::of_gpu(g)
        {
            let order: Vec<String> = p.nearest_nics().into_iter().map(|n| n.name).collect();
            all.sort_by_key(|n| order.iter().position(|o| o == n).unwrap_or(usize::MAX));
        }
        all.truncate(MAX_RAILS);
        names = all;
    }
    for (i, n) in names.iter().enumerate() {
        if names[..i].contains(n) {
            return Err(Error::invalid(
                "devices",
                n,
                "each device is one rail: named once",
            ));
        }
    }
    let mut devices = Vec::with_capacity(names.len());
    for n in &names {
        let ctx = Context::open(&list.find(n)?)?;
        let pd = ctx.alloc_pd()?;
        let max_msg = ctx
            .query_port(1)
            .map(|p| p.max_msg_sz)
            .ok()
            .filter(|&m| m > 0)
            .unwrap_or(u32::MAX);
        let windows = ctx
            .query_device()
            .is_ok_and(|a| a.memory_windows().type_2());
        if !windows && config.peer_access == PeerAccess::Windows {
            return Err(Error::Unsupported {
                what: "per-peer memory windows (EngineConfig::peer_access = Windows)".into(),
                reason: format!("{n} has no type 2 memory windows"),
            });
        }
        devices.push(RailDevice {
            name: n.clone(),
            ctx,
            pd,
            max_msg,
            windows,
        });
    }
    Ok(with_rails(config, devices))
}

fn with_rails(config: EngineConfig, devices: Vec<RailDevice>) -> Engine {
    let windows = config.peer_access != PeerAccess::Regions
        && !devices.is_empty()
        && devices.iter().all(|d| d.windows);
    Engine {
        inner: Arc::new(EngineInner {
            config,
            devices,
            cache: Mutex::new(Cache::default()),
            stats: CacheStats::default(),
            prefer: Mutex::new(HashMap::new()),
            gpu_targets: Mutex::new(Vec::new()),
            engine_id: ENGINES.fetch_add(1, Ordering::Relaxed),
            roster: Roster::default(),
            windows,
            window_counts: WindowCounts::default(),
        }),
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field(
                "devices",
                &self
                    .inner
                    .devices
                    .iter()
                    .map(|d| &d.name)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked() {
        assert!(EngineConfig::default().check().is_ok());
        // A key never shows in the settings' Debug.
        let keyed = EngineConfig {
            key: Some(AuthKey::from_bytes(b"secret key bytes 0123".to_vec()).unwrap()),
            ..Default::default()
        };
        assert!(keyed.check().is_ok());
        assert!(!format!("{keyed:?}").contains("secret"), "{keyed:?}");
        let bad = [
            EngineConfig {
                queue_depth: 1,
                ..Default::default()
            },
            EngineConfig {
                ack_timeout: Some(0),
                ..Default::default()
            },
            EngineConfig {
                notify_depth: 2,
                ..Default::default()
            },
            EngineConfig {
                max_message: 100,
                ..Default::default()
            },
            EngineConfig {
                staging_slots: 1,
                ..Default::default()
            },
            EngineConfig {
                staging_chunk: usize::MAX / 2,
                staging_slots: 4,
                ..Default::default()
            },
            EngineConfig::with_devices(&vec!["x"; 17]),
            EngineConfig {
                copy_streams: 0,
                ..Default::default()
            },
            EngineConfig {
                copy_chunk: 4096,
                ..Default::default()
            },
            EngineConfig {
                copy_lanes: 0,
                ..Default::default()
            },
            EngineConfig {
                copy_lanes: 65,
                ..Default::default()
            },
            EngineConfig {
                devices: vec!["mlx5_0".into()],
                ..EngineConfig::local()
            },
            EngineConfig {
                max_pending: 0,
                ..Default::default()
            },
            EngineConfig {
                handshake_timeout: Duration::ZERO,
                ..Default::default()
            },
            EngineConfig {
                handshake_timeout: Duration::from_secs(601),
                ..Default::default()
            },
            EngineConfig {
                peer_access: PeerAccess::Windows,
                ..EngineConfig::local()
            },
            EngineConfig {
                connect_timeout: Duration::ZERO,
                ..EngineConfig::local()
            },
            EngineConfig {
                connect_timeout: Duration::from_secs(3601),
                ..Default::default()
            },
            EngineConfig {
                deadline: Duration::ZERO,
                ..Default::default()
            },
            EngineConfig {
                spin: Duration::from_secs(2),
                ..Default::default()
            },
        ];
        for c in bad {
            assert!(
                matches!(c.check(), Err(Error::InvalidArgument { .. })),
                "{c:?}"
            );
        }
    }

    #[test]
    fn peer_access_is_chosen_per_endpoint() {
        use PeerAccess::{Auto, Regions, Windows};
        assert_eq!(EngineConfig::default().peer_access, Auto);
        let ok = |p, w, r: &[&str]| endpoint_access(p, w, r).unwrap();
        let (one, two, same) = (&["a"][..], &["a", "b"][..], &["a", "b", "a"][..]);
        // Auto: windows where the devices have them and no two rails share a device.
        assert_eq!(ok(Auto, true, one), Windows);
        assert_eq!(ok(Auto, true, two), Windows);
        assert_eq!(ok(Auto, true, same), Regions);
        assert_eq!(ok(Auto, false, one), Regions);
        // Regions whatever the devices have.
        assert_eq!(ok(Regions, true, one), Regions);
        assert_eq!(ok(Regions, false, same), Regions);
        assert_eq!(ok(Windows, true, one), Windows);
        assert_eq!(ok(Windows, true, two), Windows);
        // Windows never falls back: refused, typed, naming the shared device.
        for (w, r) in [(false, one), (true, same)] {
            let e = endpoint_access(Windows, w, r).unwrap_err();
            assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        }
        let e = endpoint_access(Windows, true, same).unwrap_err();
        assert!(e.to_string().contains("device a"), "{e}");
    }

    #[test]
    fn registrations_grant_remote_access_only_without_windows_policy() {
        let e = |p, windows| {
            let mut c = EngineConfig::local();
            c.peer_access = p;
            let mut e = with_rails(c, Vec::new());
            Arc::get_mut(&mut e.inner).unwrap().windows = windows;
            e.inner.access()
        };
        let remote = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        // Windows: only through windows, a region's own rkey reaches nothing.
        let w = e(PeerAccess::Windows, true);
        assert!(w.contains(AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE));
        assert!(!w.intersects(remote), "{w:?}");
        let a = e(PeerAccess::Auto, true);
        assert!(a.contains(remote | AccessFlags::MW_BIND), "{a:?}");
        // No windows on the devices: no MW_BIND (a device without them may refuse it).
        for p in [PeerAccess::Auto, PeerAccess::Regions] {
            let r = e(p, false);
            assert!(
                r.contains(remote) && !r.contains(AccessFlags::MW_BIND),
                "{r:?}"
            );
        }
        // An engine without rails binds no windows.
        assert!(!with_rails(EngineConfig::local(), Vec::new()).inner.windows);
    }

    #[test]
    fn an_engine_without_rails_opens_no_verbs_device() {
        // Whether or not libibverbs is here: nothing of it is asked for.
        let e = Engine::new(EngineConfig::local()).unwrap();
        assert!(e.devices().is_empty());
        assert!(e.config().local_only);
        assert_eq!(e.cache_stats().imports_opened, 0);
    }

    #[test]
    fn no_verbs_is_a_typed_error() {
        if crate::rdma::DeviceList::non_empty().is_err() {
            let e = Engine::new(EngineConfig::default()).unwrap_err();
            assert!(e.absence().is_some(), "{e}");
        }
    }
}
