//! Value parsers shared by the examples' command lines (clap): each refuses a bad value with a
//! reason, which clap prints with the value and the option before exiting with status 2.
#![allow(dead_code)]

use std::net::{IpAddr, ToSocketAddrs};

/// A size given in MiB (2^20 bytes), with its byte count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mib {
    /// As given.
    pub mib: usize,
    /// `mib * 2^20`.
    pub bytes: usize,
}

/// A positive number of MiB whose byte count fits in `usize`.
pub fn mib(s: &str) -> Result<Mib, String> {
    let mib = positive(s)?;
    let bytes = mib
        .checked_mul(1 << 20)
        .ok_or_else(|| format!("{mib} MiB is more bytes than this machine can address"))?;
    Ok(Mib { mib, bytes })
}

/// A positive integer (at least 1).
pub fn positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a whole number ({e})")),
    }
}

/// A host given by name or address, resolved when parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// As given.
    pub name: String,
    /// The first address it resolves to.
    pub ip: IpAddr,
}

/// A host name (resolved through the system's resolver) or an IPv4/IPv6 address.
pub fn host(s: &str) -> Result<Host, String> {
    let addrs = (s, 0)
        .to_socket_addrs()
        .map_err(|e| format!("not an address, and the name does not resolve ({e})"))?;
    let all: Vec<IpAddr> = addrs.map(|a| a.ip()).collect();
    // rdma_cm takes either family; prefer IPv4, which every RoCE set-up configures.
    let ip = all
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| "the name resolves to no address".to_string())?;
    Ok(Host {
        name: s.to_string(),
        ip,
    })
}

/// An [`gpudirect::Error::InvalidArgument`] for a check an example makes itself.
pub fn invalid(
    arg: &'static str,
    value: impl std::fmt::Display,
    rule: impl Into<String>,
) -> gpudirect::Error {
    gpudirect::Error::InvalidArgument {
        arg,
        value: value.to_string(),
        rule: rule.into(),
    }
}
