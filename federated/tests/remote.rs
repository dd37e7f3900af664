//! Federations whose client hosts talk to the coordinator over real QUIC sockets on loopback (hosts
//! on threads of this test; `rtx fed serve` / `rtx fed clients` run the same code as processes):
//! the global model is bit-equal to the in-process run for 1 and 3 hosts; a host that dies
//! mid-round or misses the round timeout loses only its clients, exactly like the in-process
//! `host_down` fault; wrong tokens, overlapping slices and pieces outside a host's positions are
//! refused and the rounds go on. Secure rounds (`[secagg]`) over hosts are bit-equal to the
//! in-process secure rounds; a host late in a phase, or one speaking for clients that are not its
//! own, leaves the round and the sum still unmasks exactly.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rtx_actors::{auth, Link, LinkOptions};
use rtx_federated::remote::protocol::{JoinReply, ToCoordinator, ToHost, WirePiece, COORDINATOR, HOST_ROLE};
use rtx_federated::remote::{Coordinator, CoordinatorOptions, HostConnection, HostOptions, HostSummary, RemoteRound};
use rtx_federated::{FedConfig, FedData, FedError, Federation, LogReg, LogRegSgd, Plain, Population, RoundReport};
use rtx_tensor::data::{load_digits_csv, train_val_split};

const TOKEN: &str = "test-token";

fn digits() -> Arc<FedData> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tensor/tests/fixtures/digits.csv.gz");
    let all = load_digits_csv(&path).unwrap();
    let (train, test) = train_val_split(all.n, 0.2, 0).unwrap();
    Arc::new(FedData { train: all.subset(&train), test: all.subset(&test) })
}

/// A federation config: N clients, K per round, fan-in 4 (so many leaves straddle host slices),
/// 10% dropouts, extra `[round]` and `[faults]` lines.
fn config_text(n: u64, k: u64, rounds: u32, round_extra: &str, faults_extra: &str) -> String {
    format!(
        "seed = 11\n[population]\nn_clients = {n}\ndataset = \"digits\"\n[round]\nrounds = {rounds}\nclients_per_round = {k}\nfan_in = 4\nthreads = 2\n{round_extra}[local]\nepochs = 1\nbatch_size = 4\nshuffle = true\n[faults]\ndropout_rate = 0.1\n{faults_extra}"
    )
}

fn federation<'d>(config: &FedConfig, data: &'d FedData) -> Federation<'d, LogRegSgd<'d>, Plain> {
    let shape = LogReg { n_features: data.n_features(), n_classes: data.n_classes() };
    let population = Population::new(&config.population, config.seed, &data.train.labels).unwrap();
    let l = &config.local;
    let trainer = LogRegSgd::new(shape, &data.train, l.lr, l.batch_size, l.epochs, config.strategy.mu, l.shuffle);
    Federation::new(config.clone(), population, trainer, Plain, vec![0.0; shape.n_params()]).unwrap()
}

fn in_process(text: &str, data: &FedData) -> (Vec<RoundReport>, Vec<f32>) {
    let config = FedConfig::from_toml_str(text).unwrap();
    let mut fed = federation(&config, data);
    let reports = (0..config.round.rounds).map(|_| fed.run_round().unwrap()).collect();
    (reports, fed.model().to_vec())
}

fn options(round_timeout: Duration) -> CoordinatorOptions {
    let link = LinkOptions { idle_timeout: Duration::from_secs(5), keep_alive: Duration::from_millis(500), connect_timeout: Duration::from_secs(10) };
    CoordinatorOptions { listen: "127.0.0.1:0".parse().unwrap(), token: TOKEN.into(), round_timeout, link, planted_bug: false }
}

fn host_options(addr: SocketAddr, slice: Range<u32>, delay: Duration) -> HostOptions {
    HostOptions { join: addr, token: TOKEN.into(), slice: slice.clone(), name: format!("host-{}..{}", slice.start, slice.end), pid: std::process::id(), compute_delay: delay, link: options(Duration::ZERO).link }
}

/// A client host on a thread: joins, builds its federation from the coordinator's config, serves.
fn spawn_host(addr: SocketAddr, slice: Range<u32>, data: Arc<FedData>, delay: Duration) -> JoinHandle<Result<HostSummary, FedError>> {
    std::thread::spawn(move || {
        let (connection, config, _) = HostConnection::join(host_options(addr, slice, delay))?;
        let mut fed = federation(&config, &data);
        connection.serve(&mut fed)
    })
}

/// Runs every round of `text` with client hosts of `slices` (and their delays); returns the
/// round outcomes and the final model.
fn remote(text: &str, data: &Arc<FedData>, slices: &[(Range<u32>, Duration)], round_timeout: Duration) -> (Vec<RemoteRound>, Vec<f32>) {
    let config = FedConfig::from_toml_str(text).unwrap();
    let mut coordinator = Coordinator::bind(options(round_timeout), text.to_string(), config.population.n_clients).unwrap();
    let hosts: Vec<_> = slices.iter().map(|(slice, delay)| spawn_host(coordinator.addr(), slice.clone(), data.clone(), *delay)).collect();
    coordinator.wait_for_hosts(slices.len(), Duration::from_secs(30)).unwrap();
    let mut fed = federation(&config, data);
    let rounds = (0..config.round.rounds).map(|_| coordinator.round(&mut fed).unwrap()).collect();
    coordinator.finish();
    for host in hosts {
        host.join().unwrap().unwrap();
    }
    (rounds, fed.model().to_vec())
}

fn bits(model: &[f32]) -> Vec<u32> {
    model.iter().map(|v| v.to_bits()).collect()
}

fn counts(r: &RoundReport) -> (u64, u64, u64, u64, u64, u64) {
    (r.sampled, r.clients_done, r.dropped, r.stragglers, r.rejected, r.empty)
}

#[test]
fn remote_rounds_are_bit_equal_to_in_process_rounds_for_1_and_3_hosts() {
    let data = digits();
    let text = config_text(300, 90, 3, "", "");
    let (local_reports, local_model) = in_process(&text, &data);
    let one: &[Range<u32>] = &[Range { start: 0, end: 300 }];
    let three: &[Range<u32>] = &[0..17, 17..200, 200..300];
    for slices in [one, three] {
        let slices: Vec<_> = slices.iter().map(|s| (s.clone(), Duration::ZERO)).collect();
        let (rounds, model) = remote(&text, &data, &slices, Duration::from_secs(60));
        assert_eq!(bits(&model), bits(&local_model), "{} host(s): the model differs from the in-process run", slices.len());
        for (remote, local) in rounds.iter().zip(&local_reports) {
            assert_eq!(counts(&remote.report), counts(local), "{} host(s), round {}", slices.len(), local.round);
            assert_eq!(remote.hosts_done.len(), slices.len());
            assert!(remote.hosts_lost.is_empty() && remote.hosts_late.is_empty() && remote.pieces_refused == 0);
        }
    }
}

#[test]
fn a_host_past_the_round_timeout_loses_only_its_clients_like_host_down() {
    let data = digits();
    let text = config_text(300, 90, 2, "", "");
    // The in-process twin: the same slices, host 1 down in both rounds.
    let twin = config_text(300, 90, 2, "hosts = 3\nhost_slices = [\"0..100\", \"100..160\", \"160..300\"]\n", "host_down = [{ host = 1, round = 0 }, { host = 1, round = 1 }]\n");
    let (local_reports, local_model) = in_process(&twin, &data);
    let slow = Duration::from_millis(2500);
    let slices = [(0..100, Duration::ZERO), (100..160, slow), (160..300, Duration::ZERO)];
    let (rounds, model) = remote(&text, &data, &slices, Duration::from_millis(800));
    assert_eq!(bits(&model), bits(&local_model), "the model differs from the in-process run with host 1 down");
    for (remote, local) in rounds.iter().zip(&local_reports) {
        assert_eq!(counts(&remote.report), counts(local), "round {}", local.round);
        assert_eq!(remote.hosts_late, vec!["host-100..160".to_string()], "round {}", local.round);
        assert!(remote.report.dropped > 0);
    }
}

/// A hand-driven host over a raw link: joins with `token` and `slice`, returns the link and the
/// coordinator's answer.
fn raw_join(addr: SocketAddr, token: &str, slice: Range<u32>, runtime: &tokio::runtime::Runtime) -> (Link, tokio::sync::mpsc::Receiver<rtx_actors::Inbound>, JoinReply) {
    runtime.block_on(async {
        let (link, inbound) = Link::dial(addr, LinkOptions::default()).await.unwrap();
        let ekm = link.export_keying_material(auth::EXPORTER_LABEL).unwrap();
        let join = ToCoordinator::Join { name: "raw".into(), pid: 0, slice_start: slice.start, slice_end: slice.end, proof: auth::prove(token, HOST_ROLE, &ekm) };
        let reply: JoinReply = link.remote(COORDINATOR).ask(&join, Duration::from_secs(10)).await.unwrap();
        (link, inbound, reply)
    })
}

#[test]
fn a_host_that_dies_mid_round_loses_only_its_clients_and_bad_joins_and_pieces_are_refused() {
    let data = digits();
    let text = config_text(300, 90, 2, "", "");
    let config = FedConfig::from_toml_str(&text).unwrap();
    let mut coordinator = Coordinator::bind(options(Duration::from_secs(60)), text.clone(), 300).unwrap();
    let addr = coordinator.addr();
    let good = spawn_host(addr, 0..150, data.clone(), Duration::ZERO);
    coordinator.wait_for_hosts(1, Duration::from_secs(30)).unwrap();

    // Refused joins: a wrong token, a slice overlapping the good host's, a slice outside the population.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let refusals = [("wrong-token", 150..300, "wrong token"), (TOKEN, 100..200, "overlaps"), (TOKEN, 150..301, "outside the population")];
    let pending = std::thread::scope(|scope| {
        let joins = scope.spawn(|| refusals.iter().map(|(token, slice, _)| raw_join(addr, token, slice.clone(), &runtime).2).collect::<Vec<_>>());
        // The coordinator answers joins while it waits.
        let _ = coordinator.wait_for_hosts(2, Duration::from_secs(3));
        joins.join().unwrap()
    });
    for (reply, (_, _, why)) in pending.iter().zip(&refusals) {
        assert!(matches!(reply, JoinReply::Refused { reason } if reason.contains(why)), "{reply:?} should be refused for: {why}");
    }

    // A host for 150..300 that joins properly, sends a piece outside its positions, and dies mid-round.
    let dying = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let (link, mut inbound, reply) = raw_join(addr, TOKEN, 150..300, &runtime);
        assert!(matches!(reply, JoinReply::Accepted { .. }), "{reply:?}");
        runtime.block_on(async {
            let message = inbound.recv().await.unwrap().decode::<ToHost>().unwrap();
            let ToHost::Round { round, lo, .. } = message else { panic!("expected a round, got {message:?}") };
            let outside = if lo > 0 { lo - 1 } else { 10_000 };
            let bad = ToCoordinator::Piece { round, piece: WirePiece::Untrained { pos: outside, why: 0 } };
            link.remote::<ToCoordinator>(COORDINATOR).tell(&bad).await.unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            link.close("killed");
            tokio::time::sleep(Duration::from_millis(300)).await;
        });
    });
    coordinator.wait_for_hosts(2, Duration::from_secs(30)).unwrap();
    let mut fed = federation(&config, &data);
    let first = coordinator.round(&mut fed).unwrap();
    dying.join().unwrap();
    assert_eq!(first.hosts_done, vec!["host-0..150".to_string()]);
    assert_eq!(first.hosts_lost.len(), 1, "{first:?}");
    assert!(first.pieces_refused >= 1, "the piece outside the host's positions must be refused");
    let sampled = fed.sample(0);
    let lost = sampled.iter().filter(|&&c| c >= 150).count() as u64;
    let r = &first.report;
    assert!(r.dropped >= lost, "the dead host's {lost} clients count as dropped: {r:?}");
    assert_eq!(r.clients_done + r.dropped + r.stragglers + r.rejected + r.empty, r.sampled);
    // The next round proceeds with the survivor alone.
    let second = coordinator.round(&mut fed).unwrap();
    assert_eq!(second.hosts_done, vec!["host-0..150".to_string()]);
    assert!(second.hosts_lost.is_empty() && second.report.clients_done > 0);
    coordinator.finish();
    good.join().unwrap().unwrap();
}

/// The sum, in Z_2^32, of the encoded inputs of `clients` in secure round `round` at `model`.
fn plain_sum_of(fed: &Federation<'_, LogRegSgd<'_>, Plain>, round: u32, clients: &[u64], model: &[f32]) -> Vec<u32> {
    fed.secure_plain_sum(round, clients, model).unwrap()
}

#[test]
fn secure_rounds_over_1_and_3_hosts_are_bit_equal_to_in_process_secure_rounds() {
    // Goal: `[secagg]` over client host processes: the coordinator runs the SecAgg+ server, the
    // hosts their clients; with every host answering, models, counts and the unmasked sums equal
    // the in-process secure rounds bit for bit, dropouts and unmask-phase dropouts included.
    let data = digits();
    let text = config_text(300, 90, 3, "", "") + "[secagg]\ndegree = 16\nthreshold = 9\nunmask_dropout_rate = 0.05\n";
    let config = FedConfig::from_toml_str(&text).unwrap();
    let mut local = federation(&config, &data);
    let local_reports: Vec<RoundReport> = (0..3).map(|_| local.run_round().unwrap()).collect();
    assert!(local_reports.iter().all(|r| r.secure.as_ref().is_some_and(|s| s.aborted.is_none() && s.included > 0)));
    let one: &[Range<u32>] = &[Range { start: 0, end: 300 }];
    let three: &[Range<u32>] = &[0..17, 17..200, 200..300];
    for slices in [one, three] {
        let slices: Vec<_> = slices.iter().map(|s| (s.clone(), Duration::ZERO)).collect();
        let (rounds, model) = remote(&text, &data, &slices, Duration::from_secs(60));
        assert_eq!(bits(&model), bits(local.model()), "{} host(s): the model differs from the in-process secure run", slices.len());
        for (remote, local) in rounds.iter().zip(&local_reports) {
            let round = local.round;
            assert_eq!(counts(&remote.report), counts(local), "{} host(s), round {round}", slices.len());
            let (rs, ls) = (remote.report.secure.as_ref().unwrap(), local.secure.as_ref().unwrap());
            assert_eq!((&rs.sum_fixed, rs.included, rs.gone_before_unmask), (&ls.sum_fixed, ls.included, ls.gone_before_unmask), "round {round}");
            assert_eq!(remote.hosts_done.len(), slices.len());
            assert!(remote.hosts_lost.is_empty() && remote.hosts_late.is_empty() && remote.pieces_refused == 0, "{remote:?}");
        }
    }
}

#[test]
fn a_host_late_in_a_secure_round_leaves_it_and_the_sum_still_unmasks_exactly() {
    // Goal: a host that misses a secure phase's timeout leaves that round; the protocol rebuilds
    // what its clients' neighbours hold, and the unmasked sum is exactly the sum of the included
    // clients' encoded inputs (or the round aborts with the model unchanged, never a wrong sum).
    let data = digits();
    let text = config_text(300, 90, 2, "", "") + "[secagg]\ndegree = 16\nthreshold = 9\n";
    let config = FedConfig::from_toml_str(&text).unwrap();
    let slow = Duration::from_millis(2500);
    let slices = [(0..100, Duration::ZERO), (100..130, slow), (130..300, Duration::ZERO)];
    let mut coordinator = Coordinator::bind(options(Duration::from_millis(800)), text.clone(), 300).unwrap();
    let hosts: Vec<_> = slices.iter().map(|(slice, delay)| spawn_host(coordinator.addr(), slice.clone(), data.clone(), *delay)).collect();
    coordinator.wait_for_hosts(slices.len(), Duration::from_secs(30)).unwrap();
    let mut fed = federation(&config, &data);
    let (mut unmasked, mut recovered) = (0, 0);
    for round in 0..2 {
        let before = fed.model().to_vec();
        let remote = coordinator.round(&mut fed).unwrap();
        let secure = remote.report.secure.clone().unwrap();
        eprintln!("round {round}: hosts done {:?}, late {:?}; included {}, gone before unmask {}, aborted {:?}", remote.hosts_done, remote.hosts_late, secure.included, secure.gone_before_unmask, secure.aborted);
        assert!(remote.hosts_late.contains(&"host-100..130".to_string()), "round {round}: {remote:?}");
        let r = &remote.report;
        assert_eq!(r.clients_done + r.dropped + r.stragglers + r.rejected + r.empty, r.sampled, "round {round}");
        match &secure.aborted {
            None => {
                assert_eq!(secure.included_clients.len() as u64, secure.included);
                let expected = plain_sum_of(&fed, round, &secure.included_clients, &before);
                assert_eq!(secure.sum_fixed, expected, "round {round}: the unmasked sum is not the sum of the included inputs");
                unmasked += 1;
                recovered += secure.gone_before_unmask;
            }
            Some(abort) => assert_eq!(fed.model(), &before[..], "round {round} aborted ({abort}) but the model moved"),
        }
    }
    // Round 0: the late host's clients masked before its delay, so they are in the sum and their
    // self-masks came from neighbours on the other hosts.
    assert!(unmasked > 0 && recovered > 0, "no round unmasked with clients gone before unmasking ({unmasked} unmasked, {recovered} recovered)");
    coordinator.finish();
    for host in hosts {
        host.join().unwrap().unwrap();
    }
}

#[test]
fn secure_messages_for_foreign_clients_or_phases_are_refused_and_the_round_unmasks() {
    // Goal: in a secure round, a host that speaks for clients outside its slice, answers a phase
    // it was not asked, or goes silent gets its messages refused and leaves the round; the honest
    // host's clients are unmasked exactly.
    let data = digits();
    let text = config_text(300, 90, 1, "", "") + "[secagg]\ndegree = 8\nthreshold = 5\n";
    let config = FedConfig::from_toml_str(&text).unwrap();
    let mut coordinator = Coordinator::bind(options(Duration::from_millis(1500)), text.clone(), 300).unwrap();
    let addr = coordinator.addr();
    let good = spawn_host(addr, 0..150, data.clone(), Duration::ZERO);
    coordinator.wait_for_hosts(1, Duration::from_secs(30)).unwrap();
    let rogue = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let (link, mut inbound, reply) = raw_join(addr, TOKEN, 150..300, &runtime);
        assert!(matches!(reply, JoinReply::Accepted { .. }), "{reply:?}");
        runtime.block_on(async {
            let message = inbound.recv().await.unwrap().decode::<ToHost>().unwrap();
            let ToHost::SecureRound { round, .. } = message else { panic!("expected a secure round, got {message:?}") };
            let coordinator = link.remote::<ToCoordinator>(COORDINATOR);
            // Keys for client 5, which belongs to the other host; a phase that was not asked.
            let foreign = rtx_federated::secagg::AdvertiseKeys { client: 5, mask_public: [1; 32], share_public: [2; 32] };
            coordinator.tell(&ToCoordinator::Adverts { round, adverts: vec![foreign] }).await.unwrap();
            coordinator.tell(&ToCoordinator::PhaseDone { round, phase: 3, counts: [0, 0] }).await.unwrap();
            // Then silence until the coordinator finishes.
            while let Some(message) = inbound.recv().await {
                if matches!(message.decode::<ToHost>(), Ok(ToHost::Finish)) {
                    break;
                }
            }
            link.close("done");
        });
    });
    coordinator.wait_for_hosts(2, Duration::from_secs(30)).unwrap();
    let mut fed = federation(&config, &data);
    let before = fed.model().to_vec();
    let round = coordinator.round(&mut fed).unwrap();
    let secure = round.report.secure.clone().unwrap();
    assert_eq!(round.hosts_late.len(), 1, "{round:?}");
    assert!(round.pieces_refused >= 2, "the foreign keys and the unasked phase are refused: {round:?}");
    assert!(secure.aborted.is_none(), "{secure:?}");
    assert!(secure.included_clients.iter().all(|&c| c < 150), "only the honest host's clients are in the sum: {secure:?}");
    assert_eq!(secure.sum_fixed, plain_sum_of(&fed, 0, &secure.included_clients, &before));
    coordinator.finish();
    good.join().unwrap().unwrap();
    rogue.join().unwrap();
}
