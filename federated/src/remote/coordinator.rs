//! The coordinator of a federation over QUIC (`rtx fed serve`): accepts client hosts (token proof,
//! one population slice each, slices never overlap), and drives the caller's [`Federation`] round
//! by round: it samples, tells every live host its positions and the model, gathers the hosts'
//! pieces and finishes the tree ([`Federation::finish_round`]).
//!
//! A round closes when every host it was sent to has answered or is gone, or at the round timeout
//! (measured with `tokio::time`), whichever comes first. A host that dies mid-round (its link
//! closes, or the idle timeout notices) or misses the timeout loses only its clients' updates for
//! that round; a host that died is dropped from later rounds (its clients count as dropped until a
//! host for that slice joins again); a late host's pieces for a closed round are ignored. A piece
//! for positions the host was not given is refused. Hosts may join between and during rounds;
//! they train from the next round on. Under `[secagg]` a round is the four SecAgg+ phases instead
//! (`secure_round`): this side holds the server and only ever sees masked inputs and their sum.
//!
//! The logic is [`CoordinatorCore`], on any tokio runtime and listener (the simulator drives it
//! under virtual time); [`Coordinator`] runs it over QUIC on a small runtime of its own, and the
//! caller's thread blocks in [`Coordinator::round`], so the federation (which may borrow its data)
//! never crosses threads.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rtx_actors::{auth, Inbound, Link, LinkListener, LinkOptions};
use tokio::sync::mpsc;

use super::protocol::{JoinReply, ToCoordinator, ToHost, COORDINATOR_ROLE, HOST, HOST_ROLE};
use super::protocol::secure_chunks;
use crate::error::{FedError, Result};
use crate::local::LocalTrainer;
use crate::round::{Federation, Piece, RoundReport, SecureCounts};
use crate::strategy::UpdateTransform;

/// Settings of a coordinator.
#[derive(Clone, Debug)]
pub struct CoordinatorOptions {
    /// Address to listen on (port 0 picks one).
    pub listen: SocketAddr,
    /// The shared token hosts prove they know.
    pub token: String,
    /// How long a round waits for its hosts' pieces.
    pub round_timeout: Duration,
    /// Link tuning (idle timeout: how fast a silent host counts as gone).
    pub link: LinkOptions,
    /// Test-only: plant the first bug the simulator found (a host that delivered all its pieces
    /// and then went away before the round closed lost them), so `rtx sim --planted-bug` can show
    /// its invariants catch it. Always `false` in production.
    #[doc(hidden)]
    pub planted_bug: bool,
}

/// What one round over the hosts did, beyond the federation's report.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteRound {
    /// The federation's report.
    pub report: RoundReport,
    /// Hosts that delivered all their pieces.
    pub hosts_done: Vec<String>,
    /// Hosts lost during the round (link closed or silent), with the reason.
    pub hosts_lost: Vec<(String, String)>,
    /// Hosts still working at the round timeout.
    pub hosts_late: Vec<String>,
    /// Pieces refused (outside the host's positions, malformed, for another round).
    pub pieces_refused: u64,
}

/// A joined client host.
struct Host {
    name: String,
    slice: Range<u32>,
    link: Link,
}

/// What the network tasks tell the coordinator.
enum Event {
    /// A message on connection `conn`.
    Message { conn: u64, link: Link, inbound: Inbound },
    /// Connection `conn` is gone.
    Lost { conn: u64, reason: String },
}

/// The round being gathered: its number, each host's part, the pieces (by connection) and the
/// outcome so far.
struct Gathering {
    round: u32,
    assignments: BTreeMap<u64, Assignment>,
    pieces: Vec<(u64, Piece)>,
    outcome: RemoteRound,
}

/// A host's part of the current round.
struct Assignment {
    positions: Range<usize>,
    done: bool,
}

/// The coordinator over QUIC: a small network runtime of its own and the [`CoordinatorCore`]
/// driven on it; the caller's thread blocks in each call.
pub struct Coordinator {
    runtime: tokio::runtime::Runtime,
    core: CoordinatorCore,
    addr: SocketAddr,
}

impl Coordinator {
    /// Listens for client hosts of a federation over `n_clients` clients whose config text is
    /// `config_toml` (sent to every host that joins).
    pub fn bind(options: CoordinatorOptions, config_toml: String, n_clients: u64) -> Result<Coordinator> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fed-coordinator-net")
            .enable_all()
            .build()
            .map_err(|e| FedError::link(options.listen.to_string(), format!("cannot start the network runtime: {e}")))?;
        let listener = {
            let _entered = runtime.enter();
            LinkListener::bind(options.listen, options.link.clone()).map_err(|e| FedError::link(options.listen.to_string(), e))?
        };
        let addr = listener.local_addr().map_err(|e| FedError::link(options.listen.to_string(), e))?;
        let core = {
            let _entered = runtime.enter();
            CoordinatorCore::start(Arc::new(listener), options, config_toml, n_clients)
        };
        Ok(Coordinator { runtime, core, addr })
    }

    /// The address hosts dial.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The live hosts: name and population slice, in order of their slices.
    pub fn hosts(&self) -> Vec<(String, Range<u32>)> {
        self.core.hosts()
    }

    /// Waits until `n` hosts have joined, at most `timeout`.
    pub fn wait_for_hosts(&mut self, n: usize, timeout: Duration) -> Result<()> {
        let runtime = self.runtime.handle().clone();
        runtime.block_on(self.core.wait_for_hosts(n, timeout))
    }

    /// Runs the federation's next round over the live hosts.
    pub fn round<T: LocalTrainer, X: UpdateTransform>(&mut self, federation: &mut Federation<'_, T, X>) -> Result<RemoteRound> {
        let start = Instant::now();
        let runtime = self.runtime.handle().clone();
        let mut outcome = runtime.block_on(self.core.round(federation))?;
        outcome.report.seconds = start.elapsed().as_secs_f64();
        Ok(outcome)
    }

    /// Tells every live host to exit, and stops listening.
    pub fn finish(self) {
        let Coordinator { runtime, core, .. } = self;
        runtime.block_on(core.finish());
    }
}

/// The coordinator's logic on any tokio runtime and any [`LinkListener`]: QUIC under
/// [`Coordinator`], the simulator's in-memory links under virtual time. Holds the joined hosts and
/// the events of their links.
pub struct CoordinatorCore {
    listener: Arc<LinkListener>,
    /// The listener's address, for error messages.
    addr: String,
    events: mpsc::Receiver<Event>,
    options: CoordinatorOptions,
    config_toml: String,
    n_clients: u64,
    /// Joined hosts by connection id, in join order of their connection.
    hosts: BTreeMap<u64, Host>,
    joins: u32,
}

impl CoordinatorCore {
    /// Starts accepting client hosts on `listener` (call inside a tokio runtime; `options.listen`
    /// is not used here).
    pub fn start(listener: Arc<LinkListener>, options: CoordinatorOptions, config_toml: String, n_clients: u64) -> CoordinatorCore {
        let (tx, events) = mpsc::channel(1024);
        tokio::spawn(accept_loop(listener.clone(), tx));
        let addr = listener.local_addr().map_or_else(|_| options.listen.to_string(), |a| a.to_string());
        CoordinatorCore { listener, addr, events, options, config_toml, n_clients, hosts: BTreeMap::new(), joins: 0 }
    }

    /// The live hosts: name and population slice, in order of their slices.
    pub fn hosts(&self) -> Vec<(String, Range<u32>)> {
        let mut hosts: Vec<_> = self.hosts.values().map(|h| (h.name.clone(), h.slice.clone())).collect();
        hosts.sort_by_key(|(_, slice)| slice.start);
        hosts
    }

    /// Joins accepted so far (a host that rejoins counts again).
    pub fn joins(&self) -> u32 {
        self.joins
    }

    /// Waits until `n` hosts have joined, at most `timeout`.
    pub async fn wait_for_hosts(&mut self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.hosts.len() < n {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(event)) => {
                    self.handle(event, None).await;
                }
                Ok(None) => return Err(FedError::link(&self.addr, "the listener stopped")),
                Err(_) => {
                    return Err(FedError::link(&self.addr, format!("{} of {n} client hosts joined within {} s", self.hosts.len(), timeout.as_secs_f64())));
                }
            }
        }
        Ok(())
    }

    /// Runs the federation's next round over the live hosts. `report.seconds` is left at zero
    /// (the caller's clock measures it).
    pub async fn round<T: LocalTrainer, X: UpdateTransform>(&mut self, federation: &mut Federation<'_, T, X>) -> Result<RemoteRound> {
        if federation.is_secure() {
            return self.secure_round(federation).await;
        }
        let round = federation.rounds_done();
        let sampled = federation.sample(round);
        let model = federation.model().to_vec();
        let (pieces, mut outcome) = self.gather(round, &sampled, model).await;
        outcome.report = federation.finish_round(pieces)?;
        Ok(outcome)
    }

    /// Tells every live host to exit, and stops listening.
    pub async fn finish(self) {
        for host in self.hosts.values() {
            let _ = host.link.remote::<ToHost>(HOST).tell(&ToHost::Finish).await;
        }
        // Let the tells leave before the connections close.
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.listener.close();
    }

    /// Sends round `round` to the hosts and collects their pieces until all answered, were lost,
    /// or the round timeout passed.
    async fn gather(&mut self, round: u32, sampled: &[u32], model: Vec<f32>) -> (Vec<Piece>, RemoteRound) {
        let k = sampled.len() as u32;
        let outcome = RemoteRound { report: RoundReport::default(), hosts_done: Vec::new(), hosts_lost: Vec::new(), hosts_late: Vec::new(), pieces_refused: 0 };
        let mut g = Gathering { round, assignments: BTreeMap::new(), pieces: Vec::new(), outcome };
        let conns: Vec<u64> = self.hosts.keys().copied().collect();
        for conn in conns {
            let Some(host) = self.hosts.get(&conn) else { continue };
            let lo = sampled.partition_point(|&c| c < host.slice.start);
            let hi = sampled.partition_point(|&c| c < host.slice.end);
            let message = ToHost::Round { round, k, lo: lo as u32, clients: sampled[lo..hi].to_vec(), model: model.clone() };
            match host.link.remote::<ToHost>(HOST).tell(&message).await {
                Ok(()) => {
                    g.assignments.insert(conn, Assignment { positions: lo..hi, done: false });
                }
                Err(e) => {
                    let host = self.hosts.remove(&conn).map(|h| h.name).unwrap_or_default();
                    tracing::warn!(%host, round, error = %e, "client host lost while sending the round");
                    g.outcome.hosts_lost.push((host, e.to_string()));
                }
            }
        }
        let deadline = tokio::time::Instant::now() + self.options.round_timeout;
        while g.assignments.values().any(|a| !a.done) {
            let event = match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) | Err(_) => break,
            };
            let lost = match &event {
                Event::Lost { conn, reason } => Some((*conn, reason.clone())),
                Event::Message { .. } => None,
            };
            let lost_name = self.handle(event, Some(&mut g)).await;
            // A host that already delivered everything and then went away keeps its pieces.
            let forget = self.options.planted_bug;
            if let Some((conn, reason)) = lost.filter(|(conn, _)| g.assignments.get(conn).is_some_and(|a| forget || !a.done)) {
                g.assignments.remove(&conn);
                let name = lost_name.unwrap_or_else(|| format!("connection {conn}"));
                tracing::warn!(host = %name, round, %reason, "client host lost mid-round: its clients' updates are lost for this round");
                g.outcome.hosts_lost.push((name, reason));
            }
        }
        for (conn, assignment) in &g.assignments {
            if !assignment.done {
                let name = self.hosts.get(conn).map(|h| h.name.clone()).unwrap_or_default();
                tracing::warn!(host = %name, round, "client host missed the round timeout: its clients count as dropped");
                g.outcome.hosts_late.push(name);
            }
        }
        // Only hosts that delivered everything count: a host lost or late mid-way loses all its
        // clients for the round, exactly like the in-process `host_down` fault.
        let done = |conn: &u64| g.assignments.get(conn).is_some_and(|a| a.done);
        let pieces = g.pieces.into_iter().filter(|(conn, _)| done(conn)).map(|(_, piece)| piece).collect();
        (pieces, g.outcome)
    }

    /// Handles one event; during a round, `current` is what is being gathered. For a lost
    /// connection, returns the lost host's name.
    async fn handle(&mut self, event: Event, current: Option<&mut Gathering>) -> Option<String> {
        match event {
            Event::Lost { conn, reason } => {
                let host = self.hosts.remove(&conn)?;
                tracing::warn!(host = %host.name, slice = ?host.slice, %reason, "client host left");
                Some(host.name)
            }
            Event::Message { conn, link, inbound } => {
                let message = match inbound.decode::<ToCoordinator>() {
                    Ok(message) => message,
                    Err(e) => {
                        tracing::warn!(peer = %link.peer(), error = %e, "malformed message from a client host: closing its link");
                        link.close("malformed message");
                        return None;
                    }
                };
                match message {
                    ToCoordinator::Join { name, pid, slice_start, slice_end, proof } => {
                        self.on_join(conn, &link, inbound, name, pid, slice_start..slice_end, proof).await;
                    }
                    ToCoordinator::Piece { round, piece } => {
                        let g = current?;
                        let positions = g.assignments.get(&conn).filter(|a| !a.done && round == g.round).map(|a| a.positions.clone());
                        match positions.and_then(|positions| Piece::try_from(piece).ok().filter(|p| within(p, &positions))) {
                            Some(piece) => g.pieces.push((conn, piece)),
                            None => {
                                g.outcome.pieces_refused += 1;
                                tracing::debug!(peer = %link.peer(), round, current = g.round, "piece refused");
                            }
                        }
                    }
                    ToCoordinator::Adverts { round, .. } | ToCoordinator::Shares { round, .. } | ToCoordinator::Masked { round, .. } | ToCoordinator::Unmasks { round, .. } | ToCoordinator::PhaseDone { round, .. } => {
                        tracing::debug!(peer = %link.peer(), round, "secure-round message outside its phase: ignored");
                        if let Some(g) = current {
                            g.outcome.pieces_refused += 1;
                        }
                    }
                    ToCoordinator::RoundDone { round, pieces: sent, seconds } => {
                        let g = current?;
                        if round == g.round {
                            if let Some(assignment) = g.assignments.get_mut(&conn) {
                                assignment.done = true;
                                let name = self.hosts.get(&conn).map(|h| h.name.clone()).unwrap_or_default();
                                tracing::debug!(host = %name, round, sent, seconds, "client host done");
                                g.outcome.hosts_done.push(name);
                            }
                        }
                    }
                }
                None
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn on_join(&mut self, conn: u64, link: &Link, inbound: Inbound, name: String, pid: u32, slice: Range<u32>, proof: Vec<u8>) {
        let ekm = link.export_keying_material(auth::EXPORTER_LABEL).ok();
        let verdict = if !ekm.is_some_and(|ekm| auth::verify(&self.options.token, HOST_ROLE, &ekm, &proof)) {
            Err("wrong token".to_string())
        } else if self.hosts.contains_key(&conn) {
            Err("this connection has already joined".to_string())
        } else if slice.start >= slice.end || u64::from(slice.end) > self.n_clients {
            Err(format!("population slice {}..{} is empty or outside the population of {} clients", slice.start, slice.end, self.n_clients))
        } else if let Some(other) = self.hosts.values().find(|h| h.slice.start < slice.end && slice.start < h.slice.end) {
            Err(format!("population slice {}..{} overlaps {}'s {}..{}", slice.start, slice.end, other.name, other.slice.start, other.slice.end))
        } else {
            Ok(())
        };
        match verdict {
            Ok(()) => {
                let Some(ekm) = ekm else { return };
                self.joins += 1;
                let reply = JoinReply::Accepted { host: self.joins, proof: auth::prove(&self.options.token, COORDINATOR_ROLE, &ekm), config_toml: self.config_toml.clone() };
                if let Err(e) = inbound.reply(&reply).await {
                    tracing::warn!(peer = %link.peer(), error = %e, "join reply lost");
                    return;
                }
                tracing::info!(host = %name, pid, slice = ?slice, peer = %link.peer(), "client host joined");
                self.hosts.insert(conn, Host { name, slice, link: link.clone() });
            }
            Err(reason) => {
                tracing::warn!(peer = %link.peer(), host = %name, %reason, "join refused");
                let _ = inbound.reply(&JoinReply::Refused { reason }).await;
                let closing = link.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    closing.close("join refused");
                });
            }
        }
    }
}

/// A host's part of the secure round in hand: its sampled clients.
type SecureParts = BTreeMap<u64, BTreeSet<u64>>;

impl CoordinatorCore {
    /// A secure round (`[secagg]`) over the hosts: the SecAgg+ server here, each host's sampled
    /// clients there, four phases (keys, shares, masked inputs, unmasking), each closing when every
    /// host still in the round said it is done, was lost, or at the round timeout (so a secure
    /// round takes at most four round timeouts). A host lost or late in a phase takes no further
    /// part in the round: its clients vanish at that phase, which the protocol tolerates as long
    /// as enough neighbours remain; otherwise the round is aborted with the model unchanged.
    async fn secure_round<T: LocalTrainer, X: UpdateTransform>(&mut self, federation: &mut Federation<'_, T, X>) -> Result<RemoteRound> {
        let round = federation.rounds_done();
        let sampled = federation.sample(round);
        let model = federation.model().to_vec();
        let mut server = federation.secure_server()?;
        let mut outcome = RemoteRound { report: RoundReport::default(), hosts_done: Vec::new(), hosts_lost: Vec::new(), hosts_late: Vec::new(), pieces_refused: 0 };
        let mut counts = SecureCounts { k: sampled.len() as u64, ..SecureCounts::default() };
        let mut live = SecureParts::new();
        let conns: Vec<u64> = self.hosts.keys().copied().collect();
        for conn in conns {
            let Some(host) = self.hosts.get(&conn) else { continue };
            let clients: Vec<u32> = sampled.iter().copied().filter(|c| host.slice.contains(c)).collect();
            let part = clients.iter().map(|&c| u64::from(c)).collect();
            match host.link.remote::<ToHost>(HOST).tell(&ToHost::SecureRound { round, clients, model: model.clone() }).await {
                Ok(()) => {
                    live.insert(conn, part);
                }
                Err(e) => self.lose(conn, e.to_string(), &mut live, &mut outcome),
            }
        }
        let mine = |part: &BTreeSet<u64>, client: u64| part.contains(&client);

        // Phase 0: keys.
        let [dropped, stragglers] = self
            .secure_phase(round, 0, &mut live, &mut outcome, |part, message| match message {
                ToCoordinator::Adverts { adverts, .. } => adverts.into_iter().all(|a| mine(part, a.client) && server.receive_keys(a).is_ok()),
                _ => false,
            })
            .await;
        (counts.dropped, counts.stragglers) = (dropped, stragglers);
        let rosters = match server.close_keys() {
            Ok(rosters) => rosters,
            Err(e) => return self.abort_secure(federation, e, counts, outcome),
        };

        // Phase 1: shares.
        self.send_secure(&mut live, &mut outcome, rosters, |r| r.client, |rosters, last| ToHost::Rosters { round, rosters, last }).await;
        self.secure_phase(round, 1, &mut live, &mut outcome, |part, message| match message {
            ToCoordinator::Shares { shares, .. } => shares.into_iter().all(|m| mine(part, m.client) && server.receive_shares(m).is_ok()),
            _ => false,
        })
        .await;
        let forwarded = match server.close_shares() {
            Ok(forwarded) => forwarded,
            Err(e) => return self.abort_secure(federation, e, counts, outcome),
        };

        // Phase 2: masked inputs (the hosts' clients train here).
        self.send_secure(&mut live, &mut outcome, forwarded, |f| f.client, |forwarded, last| ToHost::Forwarded { round, forwarded, last }).await;
        let [rejected, _] = self
            .secure_phase(round, 2, &mut live, &mut outcome, |part, message| match message {
                ToCoordinator::Masked { masked, .. } => mine(part, masked.client) && server.receive_masked(masked).is_ok(),
                _ => false,
            })
            .await;
        counts.rejected = rejected;
        let requests = match server.close_masked() {
            Ok(requests) => requests,
            Err(e) => return self.abort_secure(federation, e, counts, outcome),
        };

        // Phase 3: unmasking.
        self.send_secure(&mut live, &mut outcome, requests, |r| r.client, |requests, last| ToHost::UnmaskRequests { round, requests, last }).await;
        let mut answered = BTreeSet::new();
        self.secure_phase(round, 3, &mut live, &mut outcome, |part, message| match message {
            ToCoordinator::Unmasks { unmasks, .. } => unmasks.into_iter().all(|m| {
                let client = m.client;
                let ok = mine(part, client) && server.receive_unmask(m).is_ok();
                if ok {
                    answered.insert(client);
                }
                ok
            }),
            _ => false,
        })
        .await;
        outcome.hosts_done = live.keys().filter_map(|conn| self.hosts.get(conn).map(|h| h.name.clone())).collect();
        let result = server.finish();
        let gone = result.as_ref().map_or(0, |o| o.included.iter().filter(|c| !answered.contains(c)).count() as u64);
        outcome.report = federation.finish_secure_round(result, counts, gone)?;
        Ok(outcome)
    }

    /// The round could not be unmasked: the model stays, the report says why.
    fn abort_secure<T: LocalTrainer, X: UpdateTransform>(&self, federation: &mut Federation<'_, T, X>, error: FedError, counts: SecureCounts, mut outcome: RemoteRound) -> Result<RemoteRound> {
        outcome.report = federation.finish_secure_round(Err(error), counts, 0)?;
        Ok(outcome)
    }

    /// Sends each live host the phase messages addressed to its clients, in chunks, the last one
    /// flagged (an empty last chunk to a host with none, so it still answers).
    async fn send_secure<M>(&mut self, live: &mut SecureParts, outcome: &mut RemoteRound, items: Vec<M>, client_of: impl Fn(&M) -> u64, make: impl Fn(Vec<M>, bool) -> ToHost) {
        let mut by_conn: BTreeMap<u64, Vec<M>> = live.keys().map(|&conn| (conn, Vec::new())).collect();
        for item in items {
            let client = client_of(&item);
            if let Some(conn) = live.iter().find_map(|(conn, part)| part.contains(&client).then_some(*conn)) {
                by_conn.entry(conn).or_default().push(item);
            }
        }
        for (conn, items) in by_conn {
            let Some(link) = self.hosts.get(&conn).map(|h| h.link.clone()) else { continue };
            let remote = link.remote::<ToHost>(HOST);
            let mut sent = Ok(());
            for (chunk, last) in secure_chunks(items) {
                sent = remote.tell(&make(chunk, last)).await;
                if sent.is_err() {
                    break;
                }
            }
            if let Err(e) = sent {
                self.lose(conn, e.to_string(), live, outcome);
            }
        }
    }

    /// Collects phase `phase` of secure round `round` until every live host said it is done,
    /// was lost, or the round timeout passed (late hosts leave the round). `take` gets each
    /// message from a live host with that host's clients and says whether it was accepted.
    /// Returns the sum of the done hosts' counts.
    async fn secure_phase(&mut self, round: u32, phase: u8, live: &mut SecureParts, outcome: &mut RemoteRound, mut take: impl FnMut(&BTreeSet<u64>, ToCoordinator) -> bool) -> [u64; 2] {
        let mut done = BTreeSet::new();
        let mut counts = [0u64; 2];
        let deadline = tokio::time::Instant::now() + self.options.round_timeout;
        while live.keys().any(|conn| !done.contains(conn)) {
            let event = match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) | Err(_) => break,
            };
            let (conn, message) = match event {
                Event::Lost { conn, reason } => {
                    if live.contains_key(&conn) && !done.contains(&conn) {
                        self.lose(conn, reason, live, outcome);
                    } else {
                        self.handle(Event::Lost { conn, reason }, None).await;
                    }
                    continue;
                }
                Event::Message { conn, link, inbound } => match inbound.decode::<ToCoordinator>() {
                    Ok(ToCoordinator::Join { .. }) | Err(_) => {
                        self.handle(Event::Message { conn, link, inbound }, None).await;
                        continue;
                    }
                    Ok(message) => (conn, message),
                },
            };
            let Some(part) = live.get(&conn).filter(|_| !done.contains(&conn)) else {
                outcome.pieces_refused += 1;
                continue;
            };
            match message {
                ToCoordinator::PhaseDone { round: r, phase: p, counts: c } if r == round && p == phase => {
                    done.insert(conn);
                    counts[0] += c[0];
                    counts[1] += c[1];
                }
                message if secure_round_of(&message) == Some(round) => {
                    if !take(part, message) {
                        outcome.pieces_refused += 1;
                    }
                }
                _ => outcome.pieces_refused += 1,
            }
        }
        let late: Vec<u64> = live.keys().copied().filter(|conn| !done.contains(conn)).collect();
        for conn in late {
            live.remove(&conn);
            let name = self.hosts.get(&conn).map(|h| h.name.clone()).unwrap_or_default();
            tracing::warn!(host = %name, round, phase, "client host missed the secure phase's timeout: its clients leave the round");
            outcome.hosts_late.push(name);
        }
        counts
    }

    /// Host `conn` is gone mid-round: it leaves the round and the coordinator.
    fn lose(&mut self, conn: u64, reason: String, live: &mut SecureParts, outcome: &mut RemoteRound) {
        live.remove(&conn);
        let name = self.hosts.remove(&conn).map(|h| h.name).unwrap_or_else(|| format!("connection {conn}"));
        tracing::warn!(host = %name, %reason, "client host lost mid-round: its clients leave the round");
        outcome.hosts_lost.push((name, reason));
    }
}

/// The round a secure-round message belongs to.
fn secure_round_of(message: &ToCoordinator) -> Option<u32> {
    match message {
        ToCoordinator::Adverts { round, .. } | ToCoordinator::Shares { round, .. } | ToCoordinator::Masked { round, .. } | ToCoordinator::Unmasks { round, .. } => Some(*round),
        _ => None,
    }
}

/// Whether a piece covers only positions in `positions`.
fn within(piece: &Piece, positions: &Range<usize>) -> bool {
    match piece {
        Piece::Node { lo, hi, .. } => positions.start <= *lo as usize && *hi as usize <= positions.end,
        Piece::Client { pos, .. } => positions.contains(&(*pos as usize)),
    }
}

/// Accepts links and forwards their messages, tagged with a connection id.
async fn accept_loop(listener: Arc<LinkListener>, events: mpsc::Sender<Event>) {
    let mut next = 0u64;
    while let Some((link, mut inbound)) = listener.accept().await {
        next += 1;
        let conn = next;
        let events = events.clone();
        tokio::spawn(async move {
            while let Some(message) = inbound.recv().await {
                if events.send(Event::Message { conn, link: link.clone(), inbound: message }).await.is_err() {
                    return;
                }
            }
            let reason = link.closed_reason().unwrap_or_else(|| "link closed".to_string());
            let _ = events.send(Event::Lost { conn, reason }).await;
        });
    }
}
