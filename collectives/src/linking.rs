//! What the two network transports ([`crate::QuicTransport`] and [`crate::TlsTransport`]) share
//! about linking ranks: which stripe of a link a connection is ([`StripeId`]), the first bytes of
//! a stripe's hello, the collection of a link's stripes until all are connected ([`PendingLinks`]),
//! the dial loop that retries until the link is up, waiting until every peer is linked, and a
//! whole world of ranks on loopback. How a connection is made, authenticated and read stays in
//! each transport.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::quic::{ClusterCa, NodeIdentity, MAX_STRIPES};
use crate::sync::lock;

/// How long a failed dial waits before the next attempt.
pub(crate) const DIAL_RETRY: Duration = Duration::from_millis(50);

/// Which of a link's connections this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StripeId {
    pub(crate) stripe: usize,
    pub(crate) of: usize,
}

impl StripeId {
    /// A stripe index below a count of 1 to [`MAX_STRIPES`].
    pub(crate) fn is_possible(self) -> bool {
        self.of > 0 && self.of <= MAX_STRIPES && self.stripe < self.of
    }
}

/// The first 12 bytes of a hello: `magic`, the sender's rank, and the stripe it names.
pub(crate) fn hello_head(magic: [u8; 4], rank: usize, id: StripeId) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[..4].copy_from_slice(&magic);
    out[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
    // Both are below MAX_STRIPES (checked at bind and on receipt).
    out[8..10].copy_from_slice(&(id.stripe as u16).to_le_bytes());
    out[10..12].copy_from_slice(&(id.of as u16).to_le_bytes());
    out
}

/// Reads what [`hello_head`] wrote: the rank and the stripe, if `bytes` starts with `magic`.
pub(crate) fn read_hello_head(magic: [u8; 4], bytes: &[u8]) -> std::result::Result<(usize, StripeId), String> {
    if bytes.len() < 12 || bytes[..4] != magic {
        return Err("bad hello magic".into());
    }
    let rank = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
    let id = StripeId { stripe: usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), of: usize::from(u16::from_le_bytes([bytes[10], bytes[11]])) };
    Ok((rank, id))
}

/// Connected stripes of links not complete yet, by peer.
pub(crate) struct PendingLinks<P> {
    links: BTreeMap<usize, (usize, BTreeMap<usize, P>)>,
}

impl<P> Default for PendingLinks<P> {
    fn default() -> Self {
        PendingLinks { links: BTreeMap::new() }
    }
}

impl<P> PendingLinks<P> {
    /// Records stripe `id` of the link to `peer`. Returns the stripe it replaced (dialed again),
    /// and every stripe in order once all `id.of` are there. A stripe naming another count starts
    /// the link over (the peer restarted with another setting).
    pub(crate) fn add(&mut self, peer: usize, id: StripeId, part: P) -> (Option<P>, Option<Vec<P>>) {
        let entry = self.links.entry(peer).or_insert_with(|| (id.of, BTreeMap::new()));
        if entry.0 != id.of {
            *entry = (id.of, BTreeMap::new());
        }
        let stale = entry.1.insert(id.stripe, part);
        if entry.1.len() < entry.0 {
            return (stale, None);
        }
        (stale, self.links.remove(&peer).map(|(_, parts)| parts.into_values().collect()))
    }

    /// Drops every incomplete link.
    pub(crate) fn clear(&mut self) {
        self.links.clear();
    }
}

/// Checks `addrs` (one per rank), records `others` as the ranks this transport leaves to another
/// one (`unlinked`), and returns the peers `rank` dials: the higher ranks not in `others`, with
/// their addresses.
pub(crate) fn dial_targets(rank: usize, addrs: &[SocketAddr], others: &[usize], unlinked: &Mutex<BTreeSet<usize>>) -> Result<Vec<(usize, SocketAddr)>> {
    {
        let mut unlinked = lock(unlinked);
        unlinked.clear();
        unlinked.extend(others.iter().copied());
    }
    Ok(addrs.iter().copied().enumerate().skip(rank + 1).filter(|(peer, _)| !others.contains(peer)).collect())
}

/// Dials until `attempt` succeeds (the caller aborts the task when it is no longer wanted),
/// recording the last failure against `peer` for [`wait_linked`]'s error.
pub(crate) async fn dial_until_up<F, Fut>(rank: usize, peer: usize, dial_errors: &Mutex<BTreeMap<usize, String>>, mut attempt: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<(), String>>,
{
    loop {
        match attempt().await {
            Ok(()) => return,
            Err(reason) => {
                tracing::debug!(rank, peer, %reason, "dial failed, retrying");
                lock(dial_errors).insert(peer, reason);
                tokio::time::sleep(DIAL_RETRY).await;
            }
        }
    }
}

/// Waits until `missing` names no peer (checked whenever `changed` fires), or fails with
/// [`Error::Connect`] naming the first missing peer and its last dial error after `timeout`.
pub(crate) async fn wait_linked(
    changed: &watch::Sender<()>,
    missing: impl Fn() -> Option<usize>,
    timeout: Duration,
    dial_errors: &Mutex<BTreeMap<usize, String>>,
) -> Result<()> {
    let mut rx = changed.subscribe();
    let all_up = async {
        loop {
            rx.borrow_and_update();
            if missing().is_none() || rx.changed().await.is_err() {
                return;
            }
        }
    };
    if tokio::time::timeout(timeout, all_up).await.is_err() {
        if let Some(peer) = missing() {
            let reason = lock(dial_errors).get(&peer).cloned().unwrap_or_else(|| "no connection".into());
            return Err(Error::Connect { peer, timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX), reason });
        }
    }
    Ok(())
}

/// Binds `world_size` ranks on `127.0.0.1` with certificates from `ca` (`bind` makes one, `addr`
/// reads its address) and connects them all at once (`connect`).
pub(crate) async fn loopback_world<T, C, Fut>(
    ca: &ClusterCa,
    world_size: usize,
    bind: impl Fn(&NodeIdentity, SocketAddr) -> Result<T>,
    addr: impl Fn(&T) -> Result<SocketAddr>,
    connect: C,
) -> Result<Vec<Arc<T>>>
where
    T: Send + Sync + 'static,
    C: Fn(Arc<T>, Vec<SocketAddr>) -> Fut,
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    let listen = SocketAddr::from(([127, 0, 0, 1], 0));
    let transports = (0..world_size).map(|rank| Ok(Arc::new(bind(&ca.issue(rank)?, listen)?))).collect::<Result<Vec<_>>>()?;
    let addrs = transports.iter().map(|t| addr(t)).collect::<Result<Vec<_>>>()?;
    let mut connecting = tokio::task::JoinSet::new();
    for transport in &transports {
        connecting.spawn(connect(Arc::clone(transport), addrs.clone()));
    }
    while let Some(joined) = connecting.join_next().await {
        joined.map_err(|e| Error::Io { op: "connect loopback world", reason: e.to_string() })??;
    }
    Ok(transports)
}
