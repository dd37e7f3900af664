//! A client host over QUIC (`rtx fed clients`): one process holding the dormant state of a slice
//! of the population, training the slice's sampled clients each round and sending the pieces of
//! the aggregation tree back to the coordinator.
//!
//! Two steps, so the caller can load data between them and the federation may borrow it:
//! [`HostConnection::join`] dials the coordinator (or [`HostSession::join_over`] joins over a link
//! the caller made, such as the simulator's), proves the token, checks the coordinator's proof
//! and returns the federation's config; `serve` then answers rounds with the
//! caller's [`Federation`] (built from that config over the same population) until the coordinator
//! says it is over or goes away. A round message that does not fit this host (positions outside
//! the round, clients outside its slice) is answered with no pieces and logged; it never panics.

use std::net::SocketAddr;
use std::ops::Range;
use std::time::Duration;

use rtx_actors::{auth, Inbound, Link, LinkOptions};
use tokio::sync::mpsc;

use super::protocol::{JoinReply, ToCoordinator, ToHost, WirePiece, COORDINATOR, COORDINATOR_ROLE, HOST_ROLE};
use super::protocol::secure_chunks;
use crate::config::FedConfig;
use crate::error::{FedError, Result};
use crate::local::LocalTrainer;
use crate::round::{Federation, SecureHostRound};
use crate::secagg::{ForwardedShares, Roster, UnmaskRequest};
use crate::strategy::UpdateTransform;

/// Settings of a client host.
#[derive(Clone, Debug)]
pub struct HostOptions {
    /// The coordinator's address.
    pub join: SocketAddr,
    /// The shared token.
    pub token: String,
    /// The population slice this host holds.
    pub slice: Range<u32>,
    /// This host's name in the coordinator's logs.
    pub name: String,
    /// The process id the coordinator logs next to the name (the simulator gives a fixed one,
    /// so its traffic replays byte for byte).
    pub pid: u32,
    /// Extra time each round takes on this host before its pieces leave, emulating slower edge
    /// devices (deadline and failure drills); zero for none.
    pub compute_delay: Duration,
    /// Link tuning.
    pub link: LinkOptions,
}

/// What a host did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostSummary {
    /// Rounds answered.
    pub rounds: u32,
    /// Clients trained (or found dropped/late/empty) over all rounds.
    pub clients: u64,
    /// Round messages refused as not fitting this host.
    pub refused: u32,
}

/// A joined host's connection to its coordinator over QUIC: a small network runtime of its own
/// and the [`HostSession`] driven on it.
pub struct HostConnection {
    runtime: tokio::runtime::Runtime,
    session: HostSession,
    /// This host's number at the coordinator.
    pub host: u32,
}

impl HostConnection {
    /// Dials the coordinator and joins with `options.slice`; returns the connection and the
    /// federation's config.
    pub fn join(options: HostOptions) -> Result<(HostConnection, FedConfig, String)> {
        let peer = options.join.to_string();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fed-host-net")
            .enable_all()
            .build()
            .map_err(|e| FedError::link(&peer, format!("cannot start the network runtime: {e}")))?;
        let (session, config, config_toml) = runtime.block_on(async {
            let (link, inbound) = Link::dial(options.join, options.link.clone()).await.map_err(|e| FedError::link(&peer, e))?;
            HostSession::join_over(link, inbound, options).await
        })?;
        let host = session.host;
        Ok((HostConnection { runtime, session, host }, config, config_toml))
    }

    /// Answers rounds with `federation` until the coordinator finishes the federation (`Ok`) or is
    /// lost (`Err`).
    pub fn serve<T: LocalTrainer, X: UpdateTransform>(self, federation: &mut Federation<'_, T, X>) -> Result<HostSummary> {
        let HostConnection { runtime, session, .. } = self;
        runtime.block_on(session.serve(federation))
    }
}

/// A client host's logic over one link to its coordinator, on any tokio runtime: QUIC under
/// [`HostConnection`], the simulator's in-memory links under virtual time.
pub struct HostSession {
    link: Link,
    inbound: mpsc::Receiver<Inbound>,
    options: HostOptions,
    /// This host's number at the coordinator.
    pub host: u32,
}

impl HostSession {
    /// Joins over `link` (already connected to the coordinator; `options.join` names it in
    /// errors) with `options.slice`; returns the session and the federation's config.
    pub async fn join_over(link: Link, inbound: mpsc::Receiver<Inbound>, options: HostOptions) -> Result<(HostSession, FedConfig, String)> {
        let peer = options.join.to_string();
        let ekm = link.export_keying_material(auth::EXPORTER_LABEL).map_err(|e| FedError::link(&peer, e))?;
        let join = ToCoordinator::Join {
            name: options.name.clone(),
            pid: options.pid,
            slice_start: options.slice.start,
            slice_end: options.slice.end,
            proof: auth::prove(&options.token, HOST_ROLE, &ekm),
        };
        let reply: JoinReply = link.remote(COORDINATOR).ask(&join, options.link.connect_timeout).await.map_err(|e| FedError::link(&peer, e))?;
        let (host, config_toml) = match reply {
            JoinReply::Refused { reason } => return Err(FedError::JoinRefused { peer, reason }),
            JoinReply::Accepted { host, proof, config_toml } => {
                if !auth::verify(&options.token, COORDINATOR_ROLE, &ekm, &proof) {
                    link.close("the coordinator's proof is wrong");
                    return Err(FedError::link(&peer, "the coordinator could not prove it knows the token: refusing to trust it"));
                }
                (host, config_toml)
            }
        };
        let config = FedConfig::from_toml_str(&config_toml)?;
        if u64::from(options.slice.end) > config.population.n_clients {
            link.close("slice outside the population");
            return Err(FedError::config("population-slice", format!("{:?} is outside the population of {} clients", options.slice, config.population.n_clients)));
        }
        Ok((HostSession { link, inbound, options, host }, config, config_toml))
    }

    /// Whether the coordinator already said the federation is over (a `Finish` waits in the
    /// inbound queue): a host that was late for the last round finds its link closed when it
    /// answers, and that is the normal end, not a lost coordinator. Only asked once the link
    /// failed, so the queued messages it consumes (stale rounds) have no one to answer to.
    fn finish_pending(&mut self) -> bool {
        while let Ok(inbound) = self.inbound.try_recv() {
            if matches!(inbound.decode::<ToHost>(), Ok(ToHost::Finish)) {
                return true;
            }
        }
        false
    }

    /// Answers rounds with `federation` until the coordinator finishes the federation (`Ok`) or is
    /// lost (`Err`).
    pub async fn serve<T: LocalTrainer, X: UpdateTransform>(mut self, federation: &mut Federation<'_, T, X>) -> Result<HostSummary> {
        let peer = self.options.join.to_string();
        let mut summary = HostSummary::default();
        let mut secure: Option<SecureHost> = None;
        loop {
            let Some(inbound) = self.inbound.recv().await else {
                let reason = self.link.closed_reason().unwrap_or_else(|| "link closed".to_string());
                return Err(FedError::link(&peer, format!("the coordinator is gone: {reason}")));
            };
            let message = inbound.decode::<ToHost>().map_err(|e| FedError::link(&peer, format!("malformed message from the coordinator: {e}")))?;
            let sent = match message {
                ToHost::Finish => {
                    self.link.close("federation finished");
                    return Ok(summary);
                }
                ToHost::Round { round, k, lo, clients, model } => self.answer_round(federation, &mut summary, round, k, lo, clients, model).await?,
                other => self.answer_secure(federation, &mut summary, &mut secure, other).await?,
            };
            if let Err(e) = sent {
                if self.finish_pending() {
                    // The federation ended while this host was late: its messages are moot.
                    self.link.close("federation finished");
                    return Ok(summary);
                }
                return Err(FedError::link(&peer, e));
            }
        }
    }

    /// Trains a plain round's clients and sends the pieces; the outer `Err` is this host's own
    /// failure, the inner one a failed send.
    #[allow(clippy::too_many_arguments)]
    async fn answer_round<T: LocalTrainer, X: UpdateTransform>(
        &self,
        federation: &mut Federation<'_, T, X>,
        summary: &mut HostSummary,
        round: u32,
        k: u32,
        lo: u32,
        clients: Vec<u32>,
        model: Vec<f32>,
    ) -> Result<rtx_actors::Result<()>> {
        // tokio's clock: virtual under the simulator, so the reported seconds replay.
        let start = tokio::time::Instant::now();
        let fits = (lo as usize).checked_add(clients.len()).is_some_and(|hi| hi <= k as usize) && clients.iter().all(|c| self.options.slice.contains(c));
        let pieces = if fits {
            let mut sampled = vec![0u32; k as usize];
            let own = lo as usize..lo as usize + clients.len();
            sampled[own.clone()].copy_from_slice(&clients);
            federation.host_pieces(round, &model, &sampled, own)?
        } else {
            tracing::warn!(round, k, lo, clients = clients.len(), slice = ?self.options.slice, "round message does not fit this host: answering with no pieces");
            summary.refused += 1;
            Vec::new()
        };
        self.compute_delay().await;
        let count = pieces.len() as u32;
        let mut messages: Vec<ToCoordinator> = pieces.into_iter().map(|piece| ToCoordinator::Piece { round, piece: WirePiece::from(piece) }).collect();
        messages.push(ToCoordinator::RoundDone { round, pieces: count, seconds: start.elapsed().as_secs_f64() });
        let sent = self.tell_all(messages).await;
        if sent.is_ok() {
            summary.rounds += 1;
            summary.clients += clients.len() as u64;
            tracing::info!(round, clients = clients.len(), pieces = count, seconds = start.elapsed().as_secs_f64(), "round answered");
        }
        Ok(sent)
    }

    /// One step of a secure round (see the protocol): phase 0 starts this host's clients, a `last`
    /// chunk of a later phase runs that phase. Messages for another round than the one in hand
    /// are ignored (a late host's stale work).
    async fn answer_secure<T: LocalTrainer, X: UpdateTransform>(
        &self,
        federation: &mut Federation<'_, T, X>,
        summary: &mut HostSummary,
        secure: &mut Option<SecureHost>,
        message: ToHost,
    ) -> Result<rtx_actors::Result<()>> {
        let current = |round: u32, secure: &Option<SecureHost>| secure.as_ref().is_some_and(|s| s.state.round() == round);
        let mut out = Vec::new();
        match message {
            ToHost::SecureRound { round, clients, model } => {
                let fits = clients.iter().all(|c| self.options.slice.contains(c)) && clients.windows(2).all(|w| w[0] < w[1]);
                let clients = if fits {
                    clients
                } else {
                    tracing::warn!(round, slice = ?self.options.slice, "secure round names clients outside this host's slice: answering with none");
                    summary.refused += 1;
                    Vec::new()
                };
                let (state, adverts) = federation.secure_host_start(round, &clients)?;
                let (dropped, stragglers) = state.counts();
                summary.clients += clients.len() as u64;
                out.extend(secure_chunks(adverts).map(|(adverts, _)| ToCoordinator::Adverts { round, adverts }));
                out.push(ToCoordinator::PhaseDone { round, phase: 0, counts: [dropped, stragglers] });
                *secure = Some(SecureHost { state, model, rosters: Vec::new(), forwarded: Vec::new(), requests: Vec::new() });
            }
            ToHost::Rosters { round, rosters, last } if current(round, secure) => {
                let Some(host) = secure.as_mut() else { return Ok(Ok(())) };
                host.rosters.extend(rosters);
                if last {
                    let shares = host.state.share(std::mem::take(&mut host.rosters));
                    out.extend(secure_chunks(shares).map(|(shares, _)| ToCoordinator::Shares { round, shares }));
                    out.push(ToCoordinator::PhaseDone { round, phase: 1, counts: [0, 0] });
                }
            }
            ToHost::Forwarded { round, forwarded, last } if current(round, secure) => {
                let Some(host) = secure.as_mut() else { return Ok(Ok(())) };
                host.forwarded.extend(forwarded);
                if last {
                    let mut forwarded = std::mem::take(&mut host.forwarded);
                    let rejected_before = host.state.rejected;
                    // Train and mask a bounded batch at a time, sending each batch before the next.
                    while !forwarded.is_empty() {
                        let rest = forwarded.split_off(forwarded.len().min(crate::secagg::MASKING_BATCH_CLIENTS));
                        let masked = federation.secure_host_mask(&mut host.state, &host.model, forwarded)?;
                        if let Err(e) = self.tell_all(masked.into_iter().map(|masked| ToCoordinator::Masked { round, masked })).await {
                            return Ok(Err(e));
                        }
                        forwarded = rest;
                    }
                    self.compute_delay().await;
                    out.push(ToCoordinator::PhaseDone { round, phase: 2, counts: [host.state.rejected - rejected_before, 0] });
                }
            }
            ToHost::UnmaskRequests { round, requests, last } if current(round, secure) => {
                let Some(host) = secure.as_mut() else { return Ok(Ok(())) };
                host.requests.extend(requests);
                if last {
                    let unmasks = host.state.unmask(std::mem::take(&mut host.requests));
                    out.extend(secure_chunks(unmasks).map(|(unmasks, _)| ToCoordinator::Unmasks { round, unmasks }));
                    out.push(ToCoordinator::PhaseDone { round, phase: 3, counts: [0, 0] });
                    *secure = None;
                    summary.rounds += 1;
                }
            }
            other => tracing::debug!(message = ?std::mem::discriminant(&other), "secure-round message for another round: ignored"),
        }
        Ok(self.tell_all(out).await)
    }

    /// Waits out the configured compute delay (deadline drills).
    async fn compute_delay(&self) {
        if !self.options.compute_delay.is_zero() {
            tokio::time::sleep(self.options.compute_delay).await;
        }
    }

    /// Tells the coordinator `messages` in order.
    async fn tell_all(&self, messages: impl IntoIterator<Item = ToCoordinator>) -> rtx_actors::Result<()> {
        let coordinator = self.link.remote::<ToCoordinator>(COORDINATOR);
        for message in messages {
            coordinator.tell(&message).await?;
        }
        Ok(())
    }
}

/// A secure round in hand: the clients' state, the model they train at phase 2, and the chunks
/// of the phase being received.
struct SecureHost {
    state: SecureHostRound,
    model: Vec<f32>,
    rosters: Vec<Roster>,
    forwarded: Vec<ForwardedShares>,
    requests: Vec<UnmaskRequest>,
}
