//! The etcd store ([`EtcdStore`], feature `etcd`): records under `{namespace}members/{name}`,
//! each put with its own lease in a transaction that checks who holds the name; a keep-alive
//! every third of the TTL, and a watch of the publication's own key; a lease found gone (etcd
//! restarted without its data, an outage longer than the TTL) or a record removed or changed
//! by someone else: a lease granted again and the record put again; watches that list again
//! after a lost connection and report only what changed. Whatever is read is untrusted (other
//! jobs may share the etcd): records are checked, a record under no lease is no member's,
//! lists step over values too large to decode. The client is async: the store owns a small
//! tokio runtime on one thread of its own, and blocking calls wait for its tasks.

use super::feed::{Sender, channel};
use super::name::{NodeId, SegmentName};
use super::record::{MAX_RECORD, MemberRecord};
use super::store::{
    Lease, MemberEvent, MemberWatch, MetadataStore, OpCounters, Publication, StoreOps,
};
use crate::error::{Error, Result};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::sync::watch;

/// Records read per page of a list.
const PAGE: i64 = 1000;
/// The largest answer a list decodes: a page of [`PAGE`] records of at most
/// [`MAX_RECORD`] bytes, and room.
const PAGE_BYTES: usize = 16 << 20;
/// The most members a list reads.
const MAX_MEMBERS: usize = 1 << 16;
/// How soon a lost connection is tried again.
const RETRY: Duration = Duration::from_millis(250);

/// How to reach etcd and where the records live.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdConfig {
    /// The cluster's client endpoints, `host:port` (or `http://host:port`; no TLS).
    pub endpoints: Vec<String>,
    /// The prefix of every key (default `/gpudirect/v1/`): `/`, then letters, digits, `.`,
    /// `_`, `-` and `/`, ending with `/`, at most 128 bytes.
    pub namespace: String,
    /// Bound on connecting (default 3 s).
    pub connect_timeout: Duration,
    /// Bound on each request (default 3 s).
    pub op_timeout: Duration,
}

impl EtcdConfig {
    /// The default settings for these endpoints.
    pub fn new<S: AsRef<str>>(endpoints: impl IntoIterator<Item = S>) -> EtcdConfig {
        EtcdConfig {
            endpoints: endpoints
                .into_iter()
                .map(|e| e.as_ref().to_string())
                .collect(),
            namespace: "/gpudirect/v1/".into(),
            connect_timeout: Duration::from_secs(3),
            op_timeout: Duration::from_secs(3),
        }
    }

    /// With this key namespace.
    pub fn namespace(mut self, ns: impl Into<String>) -> EtcdConfig {
        self.namespace = ns.into();
        self
    }

    /// Check the settings.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub fn check(&self) -> Result<()> {
        let ns = &self.namespace;
        if ns.len() > 128
            || !ns.starts_with('/')
            || !ns.ends_with('/')
            || ns.contains("//")
            || !ns
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'))
        {
            return Err(Error::invalid(
                "namespace",
                format!("{ns:?}"),
                "'/', then letters, digits, '.', '_', '-' and '/' (no '//'), ending with '/', at \
                 most 128 bytes",
            ));
        }
        if self.endpoints.is_empty() {
            return Err(Error::invalid("endpoints", "none", "at least one endpoint"));
        }
        for e in &self.endpoints {
            if e.starts_with("https://") {
                return Err(Error::invalid(
                    "endpoints",
                    e,
                    "TLS is not supported by this store: `http://host:port` or `host:port`",
                ));
            }
            let hostport = e.strip_prefix("http://").unwrap_or(e);
            let port = hostport
                .rsplit_once(':')
                .map(|(h, p)| (h, p.parse::<u16>()));
            if !matches!(port, Some((h, Ok(p))) if !h.is_empty() && p > 0) {
                return Err(Error::invalid(
                    "endpoints",
                    e,
                    "`host:port` or `http://host:port`, the port given (etcd's clients use 2379)",
                ));
            }
        }
        for (what, t) in [
            ("connect_timeout", self.connect_timeout),
            ("op_timeout", self.op_timeout),
        ] {
            if t.is_zero() || t > Duration::from_secs(300) {
                return Err(Error::invalid(
                    what,
                    format!("{t:?}"),
                    "above 0, at most 300 s",
                ));
            }
        }
        Ok(())
    }
}

fn store_err(op: &'static str, reason: impl ToString) -> Error {
    Error::Store {
        store: "etcd",
        op,
        reason: reason.to_string(),
    }
}

/// What the store's tasks share (never the store itself, so that it can be dropped).
struct Ctx {
    client: Client,
    ops: OpCounters,
    /// `{namespace}members/`.
    prefix: String,
    op_timeout: Duration,
}

impl Ctx {
    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }
}

/// `fut` bounded by `t`, its error a store error naming `op`.
async fn bounded<T>(
    op: &'static str,
    t: Duration,
    fut: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(t, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(store_err(op, e)),
        Err(_) => Err(store_err(op, format!("no answer within {t:?}"))),
    }
}

/// The runtime's thread, stopped and joined with the store.
struct Runtime {
    handle: Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Runtime {
    fn start() -> Result<Runtime> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Os {
                call: "tokio runtime",
                source,
            })?;
        let handle = rt.handle().clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = crate::driver::ctx::spawn_thread("gpudirect-etcd", move || {
            rt.block_on(async {
                let _ = rx.await;
            });
            // Dropping the runtime ends its tasks (keep-alives, watches).
            drop(rt);
        })?;
        Ok(Runtime {
            handle,
            stop: Some(tx),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Run `task` on the runtime.
    fn detach(&self, task: impl Future<Output = ()> + Send + 'static) {
        let rt = &self.handle;
        rt.spawn(task);
    }

    /// Run `fut` on the runtime and wait for it (from any thread, in or out of a runtime).
    fn wait<T: Send + 'static>(
        &self,
        op: &'static str,
        t: Duration,
        fut: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.detach(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv_timeout(t + Duration::from_secs(1))
            .unwrap_or_else(|_| Err(store_err(op, format!("no answer within {t:?}"))))
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t {
            crate::completion::thread::join_unless_current(t);
        }
    }
}

struct Inner {
    ctx: Arc<Ctx>,
    config: EtcdConfig,
    /// The names this store publishes (one publication each: two keepers of one record would
    /// each put it back under its own lease).
    published: Mutex<HashSet<(String, NodeId)>>,
    // Dropped last: the tasks end with it.
    rt: Runtime,
}

impl Inner {
    fn listed(&self) -> std::sync::MutexGuard<'_, HashSet<(String, NodeId)>> {
        self.published.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unlist(&self, name: &(String, NodeId)) {
        self.listed().remove(name);
    }
}

/// A metadata store on etcd (feature `etcd`): see the module's docs for the key layout and
/// the leases. Cheap to clone: clones share one client and one runtime thread, which stop when
/// the last clone and the last publication made through it go.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

impl EtcdStore {
    /// Connect to etcd (one request to check that it answers).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for settings out of range; [`Error::Store`] when etcd does
    /// not answer within the connect timeout; [`Error::Os`] when its runtime or thread cannot
    /// start.
    pub fn connect(config: EtcdConfig) -> Result<EtcdStore> {
        config.check()?;
        let rt = Runtime::start()?;
        let (eps, t) = (config.endpoints.clone(), config.connect_timeout);
        let opts = ConnectOptions::new()
            .with_connect_timeout(t)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        let client = rt.wait("connect", t, async move {
            let mut c = bounded("connect", t, Client::connect(eps, Some(opts))).await?;
            bounded("connect", t, c.status()).await?;
            Ok(c)
        })?;
        let ctx = Arc::new(Ctx {
            client,
            ops: OpCounters::default(),
            prefix: format!("{}members/", config.namespace),
            op_timeout: config.op_timeout,
        });
        Ok(EtcdStore {
            inner: Arc::new(Inner {
                ctx,
                config,
                published: Mutex::default(),
                rt,
            }),
        })
    }

    /// The settings.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The key of segment `name`'s record.
    pub fn key_of(&self, name: &SegmentName) -> String {
        self.inner.ctx.key(name.as_str())
    }

    fn wait<T: Send + 'static>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        self.inner.rt.wait(op, self.inner.ctx.op_timeout, fut)
    }
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("config", &self.inner.config)
            .finish()
    }
}

/// Grant a lease of `ttl` and put `rec` under it, unless another node holds the name; the
/// lease's id. On any failure after the grant the lease is revoked: a transaction the client
/// gave up on may still be applied by etcd, and must not leave a record that nobody keeps (it
/// would be listed until the lease expired). When etcd did not answer that revoke either, the
/// lease is left in `left`, for [`revoke_left`] once the caller has answered.
async fn put_record(
    ctx: &Ctx,
    rec: &MemberRecord,
    bytes: &[u8],
    left: &mut Option<i64>,
) -> Result<i64> {
    let (mut c, t) = (ctx.client.clone(), ctx.op_timeout);
    let ttl = i64::try_from(rec.ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    OpCounters::count(&ctx.ops.grants);
    let id = bounded("lease grant", t, c.lease_grant(ttl, None))
        .await?
        .id();
    let put = put_under(ctx, &mut c, rec, bytes, id).await;
    if put.is_err() && !revoked(ctx, &mut c, id).await {
        *left = Some(id);
    }
    put.map(|()| id)
}

/// Revoke lease `id`: whether etcd answered (revoked, or it had no such lease).
async fn revoked(ctx: &Ctx, c: &mut Client, id: i64) -> bool {
    OpCounters::count(&ctx.ops.revokes);
    match tokio::time::timeout(ctx.op_timeout, c.lease_revoke(id)).await {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => lease_not_found(&e),
        Err(_) => false,
    }
}

/// A lease that a failed put left ([`put_record`]), revoked again every 250 ms until etcd
/// answers, for at most `ttl` (it has expired by then): a revoke sent while etcd stalled may be
/// dropped with the stream that carried it, and the put applied after all.
async fn revoke_left(ctx: &Ctx, id: i64, ttl: Duration) {
    let mut c = ctx.client.clone();
    let until = tokio::time::Instant::now() + ttl;
    while tokio::time::Instant::now() < until {
        tokio::time::sleep(RETRY).await;
        if revoked(ctx, &mut c, id).await {
            return;
        }
    }
}

/// Put `rec` under lease `id` in a transaction: when the key is absent; when it holds a
/// record of this node (a lease lost and granted again), under the check that it still holds
/// the same bytes; when no lease holds it (no member's, whatever it says: it would never
/// expire), under the check that it was not written since. Another node's record under a lease
/// is refused ([`Error::NameTaken`]), as is a value this library does not read under one.
async fn put_under(
    ctx: &Ctx,
    c: &mut Client,
    rec: &MemberRecord,
    bytes: &[u8],
    id: i64,
) -> Result<()> {
    /// What the key held at the last look, and so the transaction's condition.
    enum Held {
        Absent,
        Ours(Vec<u8>),
        Unleased(i64),
    }
    let t = ctx.op_timeout;
    let key = ctx.key(rec.name.as_str());
    let put = || {
        TxnOp::put(
            key.clone(),
            bytes.to_vec(),
            Some(PutOptions::new().with_lease(id)),
        )
    };
    let mut held = Held::Absent;
    for _ in 0..3 {
        OpCounters::count(&ctx.ops.puts);
        let cond = match &held {
            Held::Absent => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
            Held::Ours(old) => Compare::value(key.clone(), CompareOp::Equal, old.clone()),
            Held::Unleased(rev) => Compare::mod_revision(key.clone(), CompareOp::Equal, *rev),
        };
        // What holds the key, without its value (which may be too large to decode)...
        let txn = Txn::new()
            .when([cond])
            .and_then([put()])
            .or_else([TxnOp::get(
                key.clone(),
                Some(GetOptions::new().with_keys_only()),
            )]);
        let r = bounded("publish", t, c.txn(txn)).await?;
        if r.succeeded() {
            return Ok(());
        }
        let now = r.op_responses().into_iter().find_map(|o| match o {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| (kv.lease(), kv.mod_revision())),
            _ => None,
        });
        held = match now {
            None => Held::Absent,
            Some((0, rev)) => Held::Unleased(rev),
            // ... and, under a lease, its value (at most a record's size is read).
            Some((_, rev)) => match leased_value(ctx, c, &key, rev).await? {
                None => continue,
                Some(old) => match MemberRecord::from_bytes_at(rec.name.as_str(), &old) {
                    Ok(o) if o.node == rec.node => Held::Ours(old),
                    Ok(o) => {
                        return Err(Error::NameTaken {
                            name: rec.name.to_string(),
                            node: o.node.to_string(),
                        });
                    }
                    Err(e) => {
                        return Err(store_err(
                            "publish",
                            format!("the key holds a record this library does not read: {e}"),
                        ));
                    }
                },
            },
        };
    }
    Err(store_err("publish", "the name kept changing hands"))
}

/// The value of `key` at revision `rev` (`None` when it changed since), refused when larger
/// than a record can be.
async fn leased_value(ctx: &Ctx, c: &Client, key: &str, rev: i64) -> Result<Option<Vec<u8>>> {
    let Some(r) = get_one(ctx, c, "publish", key).await? else {
        return Err(store_err(
            "publish",
            "the key holds a value larger than any record, under a lease",
        ));
    };
    Ok(r.kvs()
        .first()
        .filter(|kv| kv.mod_revision() == rev)
        .map(|kv| kv.value().to_vec()))
}

/// `key` read with a list page's decode limit, bounded by the op timeout; `None` when its
/// value is larger even than that (no record is).
async fn get_one(
    ctx: &Ctx,
    c: &Client,
    op: &'static str,
    key: &str,
) -> Result<Option<etcd_client::GetResponse>> {
    let mut kv = c.kv_client().max_decoding_message_size(PAGE_BYTES);
    match tokio::time::timeout(ctx.op_timeout, kv.get(key, None)).await {
        Ok(Ok(r)) => Ok(Some(r)),
        Ok(Err(e)) if too_large(&e) => Ok(None),
        Ok(Err(e)) => Err(store_err(op, e)),
        Err(_) => Err(store_err(
            op,
            format!("no answer within {:?}", ctx.op_timeout),
        )),
    }
}

/// What a publication's keeper shares with its [`EtcdLease`].
struct Kept {
    lease: AtomicI64,
    republished: AtomicU64,
    /// Held while the keeper publishes again and while a revoke runs: a revoke that set `stop`
    /// before taking it sees the lease the keeper stored, and a keeper that takes it after the
    /// revoke sees `stop` and publishes nothing (else a revoked lease, seen lost, would be
    /// published again).
    gate: tokio::sync::Mutex<()>,
}

/// Whether the key holds `bytes` under a lease (ours, or another publication's of the same
/// record): asked as a transaction's comparison, so that no value is read back (one too large
/// to decode says "not held" like any other); `None` when etcd did not answer.
async fn holds(ctx: &Ctx, c: &mut Client, key: &str, bytes: &[u8], t: Duration) -> Option<bool> {
    OpCounters::count(&ctx.ops.gets);
    let txn = Txn::new().when([
        Compare::value(key, CompareOp::Equal, bytes.to_vec()),
        Compare::lease(key, CompareOp::NotEqual, 0),
    ]);
    match tokio::time::timeout(t, c.txn(txn)).await {
        Ok(Ok(r)) => Some(r.succeeded()),
        _ => None,
    }
}

/// A publication's watch of its own key, and what it said last.
enum Own {
    /// Watching (dropping the stream ends the watch).
    Watching(Box<etcd_client::WatchStream>),
    /// No watch (it could not start, or it broke): the key is read back at each keep-alive,
    /// and the watch started again.
    Reading,
}

impl Own {
    /// Watch `key`, then ask once whether it holds the record (a change before the watch
    /// began comes as no event): `None` when it no longer holds `bytes` under a lease. When
    /// etcd did not answer that, the watch is not trusted: [`Own::Reading`], asked again at the
    /// next keep-alive.
    async fn start(ctx: &Ctx, c: &mut Client, key: &str, bytes: &[u8], t: Duration) -> Option<Own> {
        OpCounters::count(&ctx.ops.watches);
        let own = match tokio::time::timeout(t, c.watch(key, None)).await {
            Ok(Ok(s)) => Own::Watching(Box::new(s)),
            _ => Own::Reading,
        };
        match holds(ctx, c, key, bytes, t).await {
            Some(true) => Some(own),
            Some(false) => None,
            None => Some(Own::Reading),
        }
    }

    /// The next change to the key: `true` once it no longer holds `bytes` under a lease
    /// (deleted, overwritten, put again without one). A broken watch falls back to
    /// [`Own::Reading`] and waits forever (the keep-alive reads instead).
    async fn changed(&mut self, bytes: &[u8]) -> bool {
        let Own::Watching(s) = self else {
            return std::future::pending().await;
        };
        match s.message().await {
            Ok(Some(r)) if !r.canceled() => r.events().iter().any(|ev| {
                ev.event_type() == EventType::Delete
                    || ev
                        .kv()
                        .is_some_and(|kv| kv.lease() == 0 || kv.value() != bytes)
            }),
            _ => {
                *self = Own::Reading;
                false
            }
        }
    }
}

/// Why a keeper's watch over its lease and key ended.
enum Ended {
    /// etcd says the lease is gone.
    Lost,
    /// The lease lives, but the key no longer holds the record.
    Moved,
    /// The connection broke, or etcd did not answer.
    Broken,
}

/// Keep `rec`'s lease alive (a keep-alive every third of its TTL, on a fixed schedule) and
/// its record in place (a watch of its own key; where that cannot run, the key asked about
/// after each keep-alive). A record deleted, overwritten or put again without a lease is put
/// back under the same lease (put-backs that follow each other within a third of the TTL pause
/// 250 ms, doubling to that third; another node's record under a lease there: asked again
/// every third of the TTL); a lease that etcd says is gone is granted again and the record put
/// again (a failed put is tried again after 250 ms, doubling to the TTL; every TTL while
/// another node holds the name). Ends when `stop` says so.
async fn keep(
    ctx: Arc<Ctx>,
    rec: MemberRecord,
    bytes: Vec<u8>,
    kept: Arc<Kept>,
    mut stop: watch::Receiver<bool>,
) {
    let period = rec.ttl / 3;
    let t = ctx.op_timeout.min(period);
    let key = ctx.key(rec.name.as_str());
    let mut c = ctx.client.clone();
    let mut pause = RETRY;
    let mut last_back: Option<tokio::time::Instant> = None;
    loop {
        let id = kept.lease.load(Ordering::Relaxed);
        // Opening the stream is a keep-alive round trip (at once: after an outage the lease
        // may be near its end); then one every period.
        OpCounters::count(&ctx.ops.keepalives);
        let ended = match tokio::time::timeout(t, c.lease_keep_alive(id)).await {
            Ok(Ok((mut keeper, mut answers))) => {
                match Own::start(&ctx, &mut c, &key, &bytes, t).await {
                    None => Ended::Moved,
                    Some(mut own) => {
                        // Fixed times: events on the key do not put the keep-alives off.
                        let mut due = tokio::time::Instant::now() + period;
                        loop {
                            tokio::select! {
                                _ = stop.changed() => return,
                                moved = own.changed(&bytes) => {
                                    if moved {
                                        break Ended::Moved;
                                    }
                                    continue;
                                }
                                _ = tokio::time::sleep_until(due) => {}
                            }
                            due = (due + period).max(tokio::time::Instant::now());
                            OpCounters::count(&ctx.ops.keepalives);
                            let one = async {
                                keeper.keep_alive().await?;
                                answers.message().await
                            };
                            match tokio::time::timeout(t, one).await {
                                Ok(Ok(Some(a))) if a.ttl() > 0 => {
                                    if matches!(own, Own::Reading) {
                                        match Own::start(&ctx, &mut c, &key, &bytes, t).await {
                                            Some(o) => own = o,
                                            None => break Ended::Moved,
                                        }
                                    }
                                }
                                // etcd answers a TTL of 0 for a lease it does not have.
                                Ok(Ok(Some(_))) => break Ended::Lost,
                                _ => break Ended::Broken,
                            }
                        }
                    }
                }
            }
            // The client's name for etcd's TTL of 0 on the stream's first answer.
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(why))) if why.contains("not found") => {
                Ended::Lost
            }
            _ => Ended::Broken,
        };
        let wait = match ended {
            // The same lease again.
            Ended::Broken => RETRY,
            Ended::Moved => {
                if last_back.is_some_and(|at| at.elapsed() < period) {
                    tokio::select! {
                        _ = stop.changed() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(period);
                } else {
                    pause = RETRY;
                }
                // Never after a revoke (the gate: see `Kept`).
                let gate = kept.gate.lock().await;
                if *stop.borrow() {
                    return;
                }
                let put = put_under(&ctx, &mut c, &rec, &bytes, id).await;
                drop(gate);
                last_back = Some(tokio::time::Instant::now());
                match put {
                    Ok(()) => {
                        kept.republished.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    // Asked again a third of the TTL later, the lease kept alive meanwhile.
                    Err(Error::NameTaken { .. }) => period,
                    Err(_) => pause,
                }
            }
            Ended::Lost => {
                republish(&ctx, &rec, &bytes, &kept, &mut stop).await;
                continue;
            }
        };
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// A lost lease: grant another and put the record again, as soon as etcd takes it (after 250
/// ms, doubling to the TTL, when a put fails; every TTL while another node holds the name);
/// never after a revoke. Returns once it is put, or when `stop` says so.
async fn republish(
    ctx: &Ctx,
    rec: &MemberRecord,
    bytes: &[u8],
    kept: &Kept,
    stop: &mut watch::Receiver<bool>,
) {
    let mut wait = RETRY;
    loop {
        let gate = kept.gate.lock().await;
        if *stop.borrow() {
            return;
        }
        let mut left = None;
        let put = put_record(ctx, rec, bytes, &mut left).await;
        if let Ok(id) = put {
            kept.lease.store(id, Ordering::Relaxed);
            kept.republished.fetch_add(1, Ordering::Relaxed);
        }
        // The gate is not held while a lease left by a failed put is revoked again: a revoke
        // of the publication does not wait for it.
        drop(gate);
        if let Some(id) = left {
            revoke_left(ctx, id, rec.ttl).await;
        }
        let w = match put {
            Ok(_) => return,
            Err(Error::NameTaken { .. }) => rec.ttl,
            // Each try is a grant, a transaction and a revoke: a key that holds what this
            // library does not read is not tried four times a second.
            Err(_) => wait,
        };
        wait = (wait * 2).min(rec.ttl);
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(w) => {}
        }
    }
}

struct EtcdLease {
    store: Arc<Inner>,
    kept: Arc<Kept>,
    stop: watch::Sender<bool>,
    /// The name and node published (listed in the store's `published` until the revoke).
    name: (String, NodeId),
}

impl Lease for EtcdLease {
    fn id(&self) -> u64 {
        self.kept.lease.load(Ordering::Relaxed) as u64
    }

    fn republished(&self) -> u64 {
        self.kept.republished.load(Ordering::Relaxed)
    }

    fn revoke(&self, timeout: Duration) -> Result<()> {
        let _ = self.stop.send(true);
        self.store.unlist(&self.name);
        let ctx = self.store.ctx.clone();
        OpCounters::count(&ctx.ops.revokes);
        let kept = self.kept.clone();
        self.store.rt.wait("lease revoke", timeout, async move {
            let _gate = kept.gate.lock().await;
            let id = kept.lease.load(Ordering::Relaxed);
            let mut c = ctx.client.clone();
            match tokio::time::timeout(timeout, c.lease_revoke(id)).await {
                Ok(Ok(_)) => Ok(()),
                // Expired or revoked already (lost while its keeper waited to publish
                // again): the record went with it.
                Ok(Err(e)) if lease_not_found(&e) => Ok(()),
                Ok(Err(e)) => Err(store_err("lease revoke", e)),
                Err(_) => Err(store_err(
                    "lease revoke",
                    format!("no answer within {timeout:?}"),
                )),
            }
        })
    }
}

/// A list of the prefix at one revision.
struct Listed {
    /// The valid records of live members (under a lease), in key order.
    records: Vec<MemberRecord>,
    /// The revision read.
    rev: i64,
    /// Cut at [`MAX_MEMBERS`]: the last name looked at (names after it were not).
    cut: Option<Vec<u8>>,
}

/// Whether etcd's answer was larger than the client decodes (tonic's own message: etcd itself
/// answers OUT_OF_RANGE for a compacted revision too, so the code alone does not tell).
fn too_large(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("message length too large"))
}

/// Whether etcd answered that it has no such lease (expired, or revoked already).
fn lease_not_found(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

/// Every valid record under the prefix (pages of up to [`PAGE`] at one revision, at most
/// [`MAX_MEMBERS`]), and that revision. A page larger than the client decodes (values that no
/// record is, put by someone else) is read again in halves, down to one key; a single key
/// whose value alone is too large is stepped over (it is no record).
async fn list(ctx: &Ctx) -> Result<Listed> {
    let t = ctx.op_timeout;
    let mut kv = ctx.client.kv_client().max_decoding_message_size(PAGE_BYTES);
    let end = prefix_end(&ctx.prefix);
    let mut from = ctx.prefix.clone().into_bytes();
    let mut out = Vec::new();
    let mut rev = 0;
    let mut page = PAGE;
    loop {
        let room = i64::try_from(MAX_MEMBERS - out.len()).unwrap_or(PAGE);
        OpCounters::count(&ctx.ops.lists);
        let mut o = GetOptions::new()
            .with_range(end.clone())
            .with_limit(page.min(room).max(1));
        if rev > 0 {
            o = o.with_revision(rev);
        }
        let r = match tokio::time::timeout(t, kv.get(from.clone(), Some(o))).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) if too_large(&e) && page > 1 => {
                page /= 2;
                continue;
            }
            Ok(Err(e)) if too_large(&e) => {
                // One key's value alone: step over the key.
                OpCounters::count(&ctx.ops.lists);
                let mut o = GetOptions::new()
                    .with_range(end.clone())
                    .with_limit(1)
                    .with_keys_only();
                if rev > 0 {
                    o = o.with_revision(rev);
                }
                let r = bounded("list", t, kv.get(from.clone(), Some(o))).await?;
                if rev == 0 {
                    rev = r.header().map_or(0, |h| h.revision());
                }
                match r.kvs().first() {
                    Some(k) => {
                        from = k.key().to_vec();
                        from.push(0);
                        continue;
                    }
                    None => {
                        return Ok(Listed {
                            records: out,
                            rev,
                            cut: None,
                        });
                    }
                }
            }
            Ok(Err(e)) => return Err(store_err("list", e)),
            Err(_) => return Err(store_err("list", format!("no answer within {t:?}"))),
        };
        if rev == 0 {
            rev = r.header().map_or(0, |h| h.revision());
        }
        for kv in r.kvs() {
            if let Some(rec) = read_kv(&ctx.prefix, kv.key(), kv.value(), kv.lease()) {
                out.push(rec);
            }
        }
        page = (page * 2).min(PAGE);
        match r.kvs().last() {
            Some(kv) if r.more() => {
                if out.len() >= MAX_MEMBERS {
                    let cut = kv
                        .key()
                        .strip_prefix(ctx.prefix.as_bytes())
                        .map(<[u8]>::to_vec);
                    return Ok(Listed {
                        records: out,
                        rev,
                        cut: Some(cut.unwrap_or_default()),
                    });
                }
                from = kv.key().to_vec();
                from.push(0);
            }
            _ => {
                return Ok(Listed {
                    records: out,
                    rev,
                    cut: None,
                });
            }
        }
    }
}

/// The first key after every key starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    // The prefix ends with '/': one more than it is '0', and nothing is between.
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// The segment name of a key under `prefix`, checked.
fn name_of(prefix: &str, key: &[u8]) -> Option<SegmentName> {
    let rest = key.strip_prefix(prefix.as_bytes())?;
    SegmentName::new(std::str::from_utf8(rest).ok()?).ok()
}

/// A record read from a key, its value and its lease: `None` when either is not valid, or
/// when no lease holds it (nothing would ever expire it: it is no live member's).
fn read_kv(prefix: &str, key: &[u8], value: &[u8], lease: i64) -> Option<MemberRecord> {
    let name = name_of(prefix, key)?;
    if lease == 0 || value.len() > MAX_RECORD {
        return None;
    }
    MemberRecord::from_bytes_at(name.as_str(), value).ok()
}

/// The revision after `rev`, a revision the store reported (untrusted: its largest stays
/// itself rather than wrapping to the smallest).
fn after(rev: i64) -> i64 {
    rev.saturating_add(1)
}

/// Watch the prefix from revision `rev` on, `known` being who held each name at `rev`; on a
/// lost connection, list again and report the difference.
async fn watch_task(
    ctx: Arc<Ctx>,
    tx: Sender<MemberEvent>,
    mut known: HashMap<SegmentName, NodeId>,
    mut rev: i64,
) {
    let mut c = ctx.client.clone();
    loop {
        OpCounters::count(&ctx.ops.watches);
        // Fragments: a revision that changes many large values comes in answers the client
        // decodes, not one past its limit.
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(after(rev))
            .with_progress_notify()
            .with_fragment();
        if let Ok(mut ws) = bounded(
            "watch",
            ctx.op_timeout,
            c.watch(ctx.prefix.clone(), Some(opts)),
        )
        .await
        {
            loop {
                let msg = tokio::select! {
                    m = ws.message() => m,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {
                        if tx.closed() {
                            return;
                        }
                        continue;
                    }
                };
                let Ok(Some(resp)) = msg else { break };
                if resp.canceled() || resp.compact_revision() > 0 {
                    break;
                }
                let mut evs = Vec::new();
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let Some(name) = name_of(&ctx.prefix, kv.key()) else {
                        continue;
                    };
                    match ev.event_type() {
                        EventType::Put => {
                            match read_kv(&ctx.prefix, kv.key(), kv.value(), kv.lease()) {
                                Some(r) => joined(&mut known, r, &mut evs),
                                // Its record overwritten by one that is not valid or has no
                                // lease: gone, as a list would say.
                                None => {
                                    if let Some(node) = known.remove(&name) {
                                        evs.push(MemberEvent::Left { name, node });
                                    }
                                }
                            }
                        }
                        EventType::Delete => {
                            if let Some(node) = known.remove(&name) {
                                evs.push(MemberEvent::Left { name, node });
                            }
                        }
                    }
                    rev = rev.max(kv.mod_revision());
                }
                if let Some(h) = resp.header() {
                    rev = rev.max(h.revision());
                }
                if !tx.send_all(evs) {
                    return;
                }
            }
        }
        // The watch broke: list again (etcd may have restarted, even without its data) and
        // report what changed.
        loop {
            if tx.closed() {
                return;
            }
            tokio::time::sleep(RETRY).await;
            if let Ok(now) = list(&ctx).await {
                let evs = diff(&mut known, now.records, now.cut.as_deref());
                rev = now.rev;
                if !tx.send_all(evs) {
                    return;
                }
                break;
            }
        }
    }
}

/// `r` published: a join (and the leave of the node that held the name before).
fn joined(known: &mut HashMap<SegmentName, NodeId>, r: MemberRecord, evs: &mut Vec<MemberEvent>) {
    match known.insert(r.name.clone(), r.node) {
        Some(old) if old == r.node => {}
        Some(old) => {
            evs.push(MemberEvent::Left {
                name: r.name.clone(),
                node: old,
            });
            evs.push(MemberEvent::Joined(r));
        }
        None => evs.push(MemberEvent::Joined(r)),
    }
}

/// The events that take `known` to `now`, a list cut after name `cut` (when it is): a name
/// after the cut was not looked at, so it is not reported gone.
fn diff(
    known: &mut HashMap<SegmentName, NodeId>,
    now: Vec<MemberRecord>,
    cut: Option<&[u8]>,
) -> Vec<MemberEvent> {
    let mut evs = Vec::new();
    let live: HashMap<SegmentName, NodeId> = now.iter().map(|r| (r.name.clone(), r.node)).collect();
    let gone: Vec<(SegmentName, NodeId)> = known
        .iter()
        .filter(|(n, _)| !live.contains_key(*n))
        .filter(|(n, _)| cut.is_none_or(|c| n.as_str().as_bytes() <= c))
        .map(|(n, id)| (n.clone(), *id))
        .collect();
    for (name, node) in gone {
        known.remove(&name);
        evs.push(MemberEvent::Left { name, node });
    }
    for r in now {
        joined(known, r, &mut evs);
    }
    evs
}

impl MetadataStore for EtcdStore {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn publish(&self, record: &MemberRecord) -> Result<Publication> {
        let bytes = record.to_bytes()?;
        let name = (record.name.to_string(), record.node);
        if !self.inner.listed().insert(name.clone()) {
            return Err(Error::invalid(
                "record",
                name.0,
                "this store publishes the name already, for this node: revoke that publication \
                 first",
            ));
        }
        // Unlisted again unless the publication is made (its revoke unlists it then).
        struct Unlist<'a>(&'a Inner, Option<(String, NodeId)>);
        impl Drop for Unlist<'_> {
            fn drop(&mut self) {
                if let Some(n) = self.1.take() {
                    self.0.unlist(&n);
                }
            }
        }
        let mut unlist = Unlist(&self.inner, Some(name.clone()));
        let ctx = self.inner.ctx.clone();
        let (rec, b) = (record.clone(), bytes.clone());
        // Whoever sets it first owns the outcome: the task, handing over the lease it put; or
        // the caller, giving up waiting, so that a put that lands after that is revoked.
        let claimed = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let late = claimed.clone();
        self.inner.rt.detach(async move {
            let mut left = None;
            let r = put_record(&ctx, &rec, &b, &mut left).await;
            if let Ok(id) = r
                && late.swap(true, Ordering::AcqRel)
            {
                left = Some(id);
            } else {
                let _ = tx.send(r);
            }
            if let Some(id) = left {
                revoke_left(&ctx, id, rec.ttl).await;
            }
        });
        // At most a grant, two transactions and a revoke, each bounded.
        let bound = self.inner.ctx.op_timeout * 4 + Duration::from_secs(1);
        let id = match rx.recv_timeout(bound) {
            Ok(r) => r?,
            Err(_) if !claimed.swap(true, Ordering::AcqRel) => {
                return Err(store_err("publish", format!("no answer within {bound:?}")));
            }
            // The task claimed it first: its answer is on the way.
            Err(_) => rx
                .recv()
                .unwrap_or_else(|_| Err(store_err("publish", "the store's runtime ended")))?,
        };
        let kept = Arc::new(Kept {
            lease: AtomicI64::new(id),
            republished: AtomicU64::new(0),
            gate: tokio::sync::Mutex::new(()),
        });
        let (stop, rx) = watch::channel(false);
        self.inner.rt.detach(keep(
            self.inner.ctx.clone(),
            record.clone(),
            bytes,
            kept.clone(),
            rx,
        ));
        Ok(Publication::new(
            record.clone(),
            Box::new(EtcdLease {
                store: self.inner.clone(),
                kept,
                stop,
                name: unlist.1.take().unwrap_or(name),
            }),
        ))
    }

    fn lookup(&self, name: &SegmentName) -> Result<Option<MemberRecord>> {
        let ctx = self.inner.ctx.clone();
        let key = ctx.key(name.as_str());
        let n = name.clone();
        OpCounters::count(&ctx.ops.gets);
        self.wait("lookup", async move {
            // No record is that large: not a store that failed, a value that is no record.
            let Some(r) = get_one(&ctx, &ctx.client, "lookup", &key).await? else {
                return Err(Error::invalid(
                    "record",
                    n.as_str(),
                    "the key holds a value larger than any record",
                ));
            };
            // A valid record under no lease is no live member's (nothing would ever expire
            // it); one that is not valid says why.
            let found = r.kvs().first().map(|kv| {
                MemberRecord::from_bytes_at(n.as_str(), kv.value())
                    .map(|rec| (kv.lease() != 0).then_some(rec))
            });
            found.transpose().map(Option::flatten)
        })
    }

    fn members(&self) -> Result<Vec<MemberRecord>> {
        let ctx = self.inner.ctx.clone();
        self.wait("list", async move { list(&ctx).await.map(|l| l.records) })
    }

    fn watch(&self) -> Result<MemberWatch> {
        let ctx = self.inner.ctx.clone();
        let now = self.wait("watch", async move { list(&ctx).await })?;
        let (tx, rx) = channel();
        let mut known = HashMap::new();
        tx.start(diff(&mut known, now.records, None));
        self.inner
            .rt
            .detach(watch_task(self.inner.ctx.clone(), tx, known, now.rev));
        Ok(MemberWatch::new(rx))
    }

    fn ops(&self) -> StoreOps {
        self.inner.ctx.ops.snapshot()
    }

    fn instance(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::super::record::sample;
    use super::*;

    #[test]
    fn namespaces_are_checked() {
        assert!(EtcdConfig::new(["127.0.0.1:2379"]).check().is_ok());
        for bad in [
            "",
            "/",
            "x/",
            "/a",
            "/a//b/",
            "/a b/",
            &format!("/{}/", "a".repeat(130)),
        ] {
            let c = EtcdConfig::new(["127.0.0.1:2379"]).namespace(bad);
            assert!(c.check().is_err() || bad == "/", "{bad:?}");
        }
        assert!(EtcdConfig::new(Vec::<String>::new()).check().is_err());
        for ok in ["etcd-0:2379", "http://10.0.0.1:2379", "[::1]:2379"] {
            assert!(EtcdConfig::new([ok]).check().is_ok(), "{ok}");
        }
        for bad in [
            "127.0.0.1",
            "https://etcd:2379",
            "etcd:",
            ":2379",
            "etcd:0",
            "etcd:70000",
        ] {
            assert!(EtcdConfig::new([bad]).check().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_watch_starts_after_the_revision_without_wrapping() {
        assert_eq!(after(0), 1);
        assert_eq!(after(41), 42);
        // A store that answers the largest revision: the watch starts there, never at the
        // smallest (which would replay or refuse everything).
        assert_eq!(after(i64::MAX), i64::MAX);
    }

    #[test]
    fn keys_and_names() {
        let p = "/gpudirect/v1/members/";
        assert_eq!(prefix_end(p), b"/gpudirect/v1/members0".to_vec());
        assert_eq!(
            name_of(p, b"/gpudirect/v1/members/a-1").unwrap().as_str(),
            "a-1"
        );
        assert!(name_of(p, b"/gpudirect/v1/members/a/b").is_none());
        assert!(name_of(p, b"/other/a").is_none());
        let r = sample("a");
        let b = r.to_bytes().unwrap();
        assert!(read_kv(p, b"/gpudirect/v1/members/a", &b, 7).is_some());
        assert!(read_kv(p, b"/gpudirect/v1/members/b", &b, 7).is_none());
        // Under no lease: no live member's.
        assert!(read_kv(p, b"/gpudirect/v1/members/a", &b, 0).is_none());
    }

    #[test]
    fn a_resync_reports_only_the_difference() {
        let (a, b, c) = (sample("a"), sample("b"), sample("c"));
        let mut known = HashMap::new();
        assert_eq!(diff(&mut known, vec![a.clone(), b.clone()], None).len(), 2);
        assert!(diff(&mut known, vec![a.clone(), b.clone()], None).is_empty());
        let mut b2 = b.clone();
        b2.node = NodeId::random().unwrap();
        let evs = diff(&mut known, vec![b2.clone(), c.clone()], None);
        assert_eq!(
            evs,
            vec![
                MemberEvent::Left {
                    name: a.name.clone(),
                    node: a.node
                },
                MemberEvent::Left {
                    name: b.name.clone(),
                    node: b.node
                },
                MemberEvent::Joined(b2),
                MemberEvent::Joined(c),
            ]
        );
    }

    #[test]
    fn a_cut_list_reports_no_leave_past_its_cut() {
        let (a, m, z) = (sample("a"), sample("m"), sample("z"));
        let mut known = HashMap::new();
        diff(&mut known, vec![a.clone(), m.clone(), z.clone()], None);
        // Listed up to "m" only: "m" is gone, "z" was not looked at.
        let evs = diff(&mut known, vec![a.clone()], Some(b"m"));
        assert_eq!(
            evs,
            vec![MemberEvent::Left {
                name: m.name.clone(),
                node: m.node
            }]
        );
        assert_eq!(known.get(&z.name), Some(&z.node));
    }
}
