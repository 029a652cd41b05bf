//! Endpoints found by name: the engine's record built from what it advertises and published
//! through its roster, a name resolved to a record and dialled (over the rails, or inside the
//! node when the record says the peer is on this host), and the endpoint handed to the roster,
//! which ends it when the peer leaves.

use super::descriptor::MemoryDescriptor;
use super::endpoint::{Endpoint, WeakEndpoint};
use super::engine::Engine;
#[cfg(feature = "p2p")]
use super::local;
use super::membership::{
    Advertise, HostId, MemberRecord, MetadataStore, NodeId, SegmentName, Tracked,
};
use super::meter;
use super::rails;
use crate::error::{Error, Result};
use std::sync::Arc;
use std::time::Instant;

/// Give `engine` `store` (the first one given stays).
///
/// # Errors
///
/// As [`Engine::use_store`].
pub(crate) fn attach<S: MetadataStore + Clone>(engine: &Engine, store: &S) -> Result<()> {
    let s = store.clone();
    engine
        .inner
        .roster
        .attach(store.instance(), move || Arc::new(s))
        .map(drop)
}

/// Publish `engine` as `name`, reachable as `at` says.
///
/// # Errors
///
/// As [`Engine::publish_as`].
pub(crate) fn publish(engine: &Engine, name: &str, at: &Advertise) -> Result<()> {
    let name = SegmentName::new(name)?;
    let rails = engine.inner.devices.len();
    if at.rails.len() > rails {
        return Err(Error::invalid(
            "advertised rails",
            at.rails.len(),
            format!("at most one address per rail of the engine ({rails})"),
        ));
    }
    if at.local.is_some() && !cfg!(feature = "p2p") {
        return Err(Error::invalid(
            "advertised local socket",
            "set",
            "intra-node endpoints need the `p2p` feature",
        ));
    }
    let roster = &engine.inner.roster;
    let rec = MemberRecord {
        name,
        node: roster.node()?,
        host: match &at.host {
            Some(h) => h.clone(),
            None => HostId::this_host()?,
        },
        rails: at.rails.clone(),
        local: at.local.clone(),
        ttl: at.ttl,
    };
    rec.check()?;
    roster.publish(&rec)
}

/// The record of segment `name` in `engine`'s store.
fn resolve(engine: &Engine, name: &str) -> Result<MemberRecord> {
    let name = SegmentName::new(name)?;
    let store = engine.inner.roster.store()?;
    store.lookup(&name)?.ok_or_else(|| Error::UnknownName {
        name: name.to_string(),
    })
}

/// Connect to segment `name`.
///
/// # Errors
///
/// As [`Engine::connect_name`].
pub(crate) fn connect(
    engine: &Engine,
    name: &str,
    publish: &[MemoryDescriptor],
) -> Result<Endpoint> {
    let rec = resolve(engine, name)?;
    let started = Instant::now();
    let ep = dial(engine, &rec, publish);
    let secs = started.elapsed().as_secs_f64();
    let via = match &ep {
        Ok(e) if e.rails() == 0 => "local",
        _ if rec.rails.is_empty() => "local",
        _ => "rails",
    };
    meter::handshake(
        rec.name.as_str(),
        "connect",
        via,
        ep.is_ok().then_some(secs),
    );
    let ep = ep?;
    ep.name_peer(rec.name.as_str());
    engine
        .inner
        .roster
        .track(&rec, Box::new(Named(ep.downgrade())));
    Ok(ep)
}

/// End `ep` when segment `name`'s current node leaves.
///
/// # Errors
///
/// As [`Engine::watch_peer`].
pub(crate) fn watch(engine: &Engine, ep: &Endpoint, name: &str) -> Result<()> {
    let rec = resolve(engine, name)?;
    ep.name_peer(rec.name.as_str());
    engine
        .inner
        .roster
        .track(&rec, Box::new(Named(ep.downgrade())));
    Ok(())
}

/// Whether `rec` is a member on this host.
#[cfg(feature = "p2p")]
fn same_host(engine: &Engine, rec: &MemberRecord) -> bool {
    let mine = match engine.inner.roster.published() {
        Some(r) => Ok(r.host),
        None => HostId::this_host(),
    };
    mine.is_ok_and(|h| h == rec.host)
}

/// Dial `rec`'s member: inside the node when it is on this host and listens locally (with the
/// `p2p` feature), else over its rails.
fn dial(engine: &Engine, rec: &MemberRecord, publish: &[MemoryDescriptor]) -> Result<Endpoint> {
    #[cfg(feature = "p2p")]
    if let Some(path) = &rec.local
        && same_host(engine, rec)
    {
        return Endpoint::inside_node(local::connect(engine, path, publish)?);
    }
    if rec.rails.is_empty() {
        return Err(Error::invalid(
            "segment",
            rec.name.as_str(),
            "the member is reachable only inside its own host",
        ));
    }
    let peers: Vec<&str> = rec.rails.iter().map(String::as_str).collect();
    Ok(Endpoint::over_rails(rails::connect(
        engine, &peers, publish,
    )?))
}

/// An endpoint as the roster holds it: not keeping it open.
struct Named(WeakEndpoint);

impl Tracked for Named {
    fn alive(&self) -> bool {
        self.0.upgrade().is_some()
    }

    fn peer_left(&self, name: &SegmentName, node: NodeId) {
        if let Some(ep) = self.0.upgrade() {
            ep.peer_left(name.as_str(), &node.to_string());
        }
    }
}
