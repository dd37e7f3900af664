//! Secure aggregation end to end through the two state machines: exact unmasked sums under dropouts
//! at every phase, a masked update that looks like uniform noise, typed errors for too many dropouts
//! and for malformed messages, and a property test over random dropout sets against an independent
//! model of which rounds can be unmasked.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use rtx_federated::secagg::{neighbour_graph, plain_fixed_sum, run_round, Dropouts, QuantConfig, SecAggClient, SecAggConfig, SecAggServer, ShareReveal};
use rtx_federated::FedError;

/// The seed of a randomized test: `RTX_TEST_SEED` if set (to replay a failure), else `default`.
fn test_seed(default: u64) -> u64 {
    let seed = std::env::var("RTX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    eprintln!("seed {seed} (replay with RTX_TEST_SEED={seed})");
    seed
}

fn updates(n: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    (0..n).map(|_| (0..len).map(|_| rng.random_range(-1.5f32..1.5)).collect()).collect()
}

fn config(n: u64, len: usize, degree: usize, threshold: usize, seed: u64) -> SecAggConfig {
    SecAggConfig::new(3, len, degree, threshold, QuantConfig::finest(1.0, n).unwrap(), seed).unwrap()
}

fn expected_sum(config: &SecAggConfig, clients: &[u64], updates: &[Vec<f32>], included: &BTreeSet<u64>) -> Vec<u32> {
    let chosen = clients.iter().zip(updates).filter(|(c, _)| included.contains(c)).map(|(_, u)| u.as_slice());
    plain_fixed_sum(&config.quant, chosen, config.vector_len)
}

#[test]
fn unmasked_sum_equals_plain_fixed_point_sum_under_dropouts() {
    // Goal: the unmasked sum is bit-for-bit the plain fixed-point sum of exactly the clients whose
    // input arrived, with no dropout, one, and several at every phase (including clients that drop
    // after sending their masked input). Method: 40 clients on a degree-8 graph, threshold 5.
    let seed = test_seed(11);
    let n = 40u64;
    let clients: Vec<u64> = (0..n).map(|c| 1000 + 17 * c).collect();
    let ups = updates(n as usize, 203, seed);
    let cfg = config(n, 203, 8, 5, seed);
    let set = |ids: &[u64]| ids.iter().map(|&i| clients[i as usize]).collect::<BTreeSet<u64>>();
    let cases = [
        ("none", Dropouts::default()),
        ("one before masked input", Dropouts { before_masked_input: set(&[7]), ..Dropouts::default() }),
        ("one after masked input", Dropouts { before_unmask: set(&[7]), ..Dropouts::default() }),
        ("several at every phase", Dropouts { before_sharing: set(&[1, 2]), before_masked_input: set(&[5, 20, 33]), before_unmask: set(&[9, 10, 39]) }),
    ];
    for (name, drops) in &cases {
        let outcome = run_round(&cfg, &clients, &ups, drops, seed).unwrap();
        let included: BTreeSet<u64> = clients.iter().copied().filter(|c| !drops.before_sharing.contains(c) && !drops.before_masked_input.contains(c)).collect();
        assert_eq!(outcome.included, included.iter().copied().collect::<Vec<_>>(), "{name}");
        assert_eq!(outcome.dropped, drops.before_masked_input.iter().copied().collect::<Vec<_>>(), "{name}");
        assert_eq!(outcome.sum_fixed, expected_sum(&cfg, &clients, &ups, &included), "{name}");
        // And the decoded floats are the float sum up to the quantisation grid.
        let tolerance = included.len() as f32 * 0.5 / cfg.quant.scale() as f32 + 1e-4;
        for (k, &got) in outcome.sum.iter().enumerate() {
            let want: f32 = clients.iter().zip(&ups).filter(|(c, _)| included.contains(c)).map(|(_, u)| u[k].clamp(-1.0, 1.0)).sum();
            assert!((got - want).abs() <= tolerance, "{name}: coordinate {k}: {got} vs {want}");
        }
    }
    // The same seed gives the same masks and shares: the round is deterministic.
    let again = run_round(&cfg, &clients, &ups, &cases[3].1, seed).unwrap();
    assert_eq!(again, run_round(&cfg, &clients, &ups, &cases[3].1, seed).unwrap());
}

/// Pearson's chi-square statistic of the byte histogram of `words` against the uniform distribution.
fn byte_chi_square(words: &[u32]) -> f64 {
    let mut counts = [0u64; 256];
    for w in words {
        for b in w.to_le_bytes() {
            counts[b as usize] += 1;
        }
    }
    let expected = (words.len() * 4) as f64 / 256.0;
    counts.iter().map(|&c| (c as f64 - expected).powi(2) / expected).sum()
}

fn correlation(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    cov / (va * vb).sqrt()
}

#[test]
fn server_view_of_one_masked_update_is_indistinguishable_from_noise() {
    // Goal: what the server receives from one client carries no visible trace of the update.
    // Method: drive 6 clients by hand; take client 2's masked input (16,384 words). Its bytes pass a
    // chi-square test for uniformity (255 degrees of freedom, critical value 330.5 at p = 0.001) and
    // its words (as signed integers) correlate with the plain update by less than 4 / sqrt(n). The
    // plain quantised update itself fails both checks, so the checks can fail.
    let seed = test_seed(5);
    let len = 16_384;
    let n = 6u64;
    let cfg = config(n, len, 4, 3, seed);
    // A structured update (a smooth ramp): the easiest kind to spot through weak masking.
    let update: Vec<f32> = (0..len).map(|i| ((i as f32) / 1000.0).sin()).collect();
    let mut server = SecAggServer::new(&cfg);
    let mut clients: Vec<SecAggClient> = (0..n)
        .map(|id| {
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            rng.set_stream(id);
            SecAggClient::new(id, &cfg, rng).unwrap()
        })
        .collect();
    for c in clients.iter_mut() {
        server.receive_keys(c.advertise().unwrap()).unwrap();
    }
    for roster in server.close_keys().unwrap() {
        let msg = clients[roster.client as usize].share_keys(&roster).unwrap();
        server.receive_shares(msg).unwrap();
    }
    let forwarded = server.close_shares().unwrap();
    let masked = clients[2].masked_input(&forwarded[2], &update).unwrap().masked;

    let plain: Vec<u32> = update.iter().map(|&v| cfg.quant.quantize(v)).collect();
    let as_f64 = |w: &[u32]| w.iter().map(|&x| f64::from(x as i32)).collect::<Vec<f64>>();
    let chi_masked = byte_chi_square(&masked);
    let chi_plain = byte_chi_square(&plain);
    let corr_masked = correlation(&as_f64(&masked), &as_f64(&plain));
    let corr_limit = 4.0 / (len as f64).sqrt();
    eprintln!("chi-square masked {chi_masked:.1}, plain {chi_plain:.1}; correlation masked {corr_masked:.4} (limit {corr_limit:.4})");
    assert!(chi_masked < 330.5, "masked bytes are not uniform: chi-square {chi_masked}");
    assert!(corr_masked.abs() < corr_limit, "masked words correlate with the update: {corr_masked}");
    assert!(chi_plain > 330.5, "the check cannot tell the plain update from noise: {chi_plain}");
    assert!(correlation(&as_f64(&plain), &as_f64(&plain)) > 0.99);
}

#[test]
fn too_many_dropouts_is_a_typed_error_never_a_wrong_sum() {
    // Goal: when fewer than t neighbours of a client answer, the round fails with TooFewShares naming
    // that client, for both secrets. Method: degree 4, threshold 3, 12 clients; silence neighbours
    // of one client (found from the same seeded graph the server builds).
    let seed = test_seed(21);
    let n = 12u64;
    let clients: Vec<u64> = (0..n).collect();
    let ups = updates(n as usize, 31, seed);
    let cfg = config(n, 31, 4, 3, seed);
    let graph = neighbour_graph(&clients, 4, seed);
    let victim = 5u64;
    let silent: BTreeSet<u64> = graph[&victim].iter().copied().take(2).collect();

    // The victim's input arrived but only 2 of its 4 neighbours answer: its self-mask seed is lost.
    let drops = Dropouts { before_unmask: silent.clone(), ..Dropouts::default() };
    match run_round(&cfg, &clients, &ups, &drops, seed) {
        Err(FedError::SecAggTooFewShares { client, secret, have, threshold }) => {
            assert_eq!((client, secret, have, threshold), (victim, "self-mask seed", 2, 3));
        }
        other => panic!("expected TooFewShares for {victim}, got {other:?}"),
    }
    // The victim dropped after sharing and 2 neighbours are silent: its mask key is lost.
    let mut before_masked = BTreeSet::from([victim]);
    before_masked.extend(&silent);
    let drops = Dropouts { before_masked_input: before_masked, ..Dropouts::default() };
    match run_round(&cfg, &clients, &ups, &drops, seed) {
        Err(FedError::SecAggTooFewShares { client, secret: "mask key", have, threshold: 3 }) => {
            assert!(have < 3);
            assert!(client == victim || silent.contains(&client), "client {client}");
        }
        other => panic!("expected TooFewShares(mask key), got {other:?}"),
    }
    // Fewer clients than threshold + 1 cannot even start.
    let few = &clients[..3];
    let err = run_round(&cfg, few, &ups[..3], &Dropouts::default(), seed).unwrap_err();
    assert!(matches!(err, FedError::SecAggTooFewClients { phase: "advertise keys", have: 3, need: 4 }), "{err}");
}

#[test]
fn malformed_messages_get_typed_errors_and_the_round_goes_on() {
    // Goal: wrong lengths, unknown clients, duplicates, tampered shares, contradictory requests and
    // out-of-phase calls are refused with the matching typed error, and refusing them leaves the
    // round able to finish with the exact sum. Method: 8 clients driven by hand.
    let seed = test_seed(3);
    let n = 8u64;
    let len = 64;
    let cfg = config(n, len, 4, 3, seed);
    let ups = updates(n as usize, len, seed);
    let mut server = SecAggServer::new(&cfg);
    let mut clients: Vec<SecAggClient> = (0..n)
        .map(|id| {
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            rng.set_stream(id);
            SecAggClient::new(id, &cfg, rng).unwrap()
        })
        .collect();
    let adverts: Vec<_> = clients.iter_mut().map(|c| c.advertise().unwrap()).collect();
    for a in &adverts {
        server.receive_keys(a.clone()).unwrap();
    }
    assert!(matches!(server.receive_keys(adverts[0].clone()), Err(FedError::SecAggDuplicate { client: 0, .. })));
    assert!(matches!(server.receive_masked(rtx_federated::secagg::MaskedInput { client: 0, masked: vec![0; len] }), Err(FedError::SecAggPhase { .. })));
    assert!(matches!(clients[0].advertise(), Err(FedError::SecAggPhase { .. })));
    let rosters = server.close_keys().unwrap();

    let mut share_msgs: Vec<_> = rosters.iter().map(|r| clients[r.client as usize].share_keys(r).unwrap()).collect();
    // A share set with a share for a non-neighbour, one with a duplicate, one too short: all refused.
    let outsider = (0..n).find(|c| *c != 0 && !rosters[0].neighbours.iter().any(|k| k.client == *c)).unwrap();
    let mut bad = share_msgs[0].clone();
    bad.shares[0].to = outsider;
    assert!(matches!(server.receive_shares(bad), Err(FedError::SecAggUnknownClient { client, .. }) if client == outsider));
    let mut bad = share_msgs[0].clone();
    bad.shares[1] = bad.shares[0].clone();
    assert!(matches!(server.receive_shares(bad), Err(FedError::SecAggDuplicate { client: 0, .. })));
    let mut bad = share_msgs[0].clone();
    bad.shares[0].ciphertext.pop();
    assert!(matches!(server.receive_shares(bad), Err(FedError::SecAggMalformed { client: 0, .. })));
    // A tampered (but well-sized) share passes the server, which cannot read it, and is caught by the
    // addressee's AEAD: client 0's share for its first neighbour gets one bit flipped.
    let tampered_for = share_msgs[0].shares[0].to;
    share_msgs[0].shares[0].ciphertext[20] ^= 1;
    for msg in share_msgs {
        server.receive_shares(msg).unwrap();
    }
    let forwarded = server.close_shares().unwrap();
    let fwd_victim = forwarded[tampered_for as usize].clone();
    match clients[tampered_for as usize].masked_input(&fwd_victim, &ups[tampered_for as usize]) {
        Err(FedError::SecAggMalformed { client: 0, reason, .. }) => assert!(reason.contains("does not open"), "{reason}"),
        other => panic!("expected a malformed share from 0, got {other:?}"),
    }
    // The client that got the tampered share drops out of the round (it sends no masked input).
    let mut masked_ok = BTreeSet::new();
    for fwd in &forwarded {
        if fwd.client == tampered_for {
            continue;
        }
        let c = &mut clients[fwd.client as usize];
        // Wrong-length update: refused by the client itself.
        assert!(matches!(c.masked_input(fwd, &ups[0][..len - 1]), Err(FedError::SecAggMalformed { .. })));
        let msg = c.masked_input(fwd, &ups[fwd.client as usize]).unwrap();
        let mut short = msg.clone();
        short.masked.pop();
        assert!(matches!(server.receive_masked(short), Err(FedError::SecAggMalformed { .. })));
        assert!(matches!(
            server.receive_masked(rtx_federated::secagg::MaskedInput { client: 999, masked: msg.masked.clone() }),
            Err(FedError::SecAggUnknownClient { client: 999, .. })
        ));
        server.receive_masked(msg.clone()).unwrap();
        assert!(matches!(server.receive_masked(msg), Err(FedError::SecAggDuplicate { .. })));
        masked_ok.insert(fwd.client);
    }
    let requests = server.close_masked().unwrap();
    for request in &requests {
        let c = &mut clients[request.client as usize];
        if let Some(&s) = request.survivors.first() {
            // A request naming a survivor as dropped too would reveal both of its secrets: refused.
            let mut both = request.clone();
            both.dropped.push(s);
            assert!(matches!(c.unmask(&both), Err(FedError::SecAggMalformed { client, .. }) if client == s));
        }
        let answer = c.unmask(request).unwrap();
        if let Some(first) = answer.self_mask_shares.first().cloned() {
            let mut dup = answer.clone();
            dup.self_mask_shares.push(first);
            assert!(matches!(server.receive_unmask(dup), Err(FedError::SecAggDuplicate { .. })));
            let mut wrong = answer.clone();
            wrong.mask_key_shares.push(ShareReveal { owner: wrong.self_mask_shares[0].owner, share: vec![1; 8] });
            assert!(server.receive_unmask(wrong).is_err());
            let mut short = answer.clone();
            short.self_mask_shares[0].share.pop();
            assert!(matches!(server.receive_unmask(short), Err(FedError::SecAggMalformed { .. })));
        }
        server.receive_unmask(answer.clone()).unwrap();
        assert!(matches!(server.receive_unmask(answer), Err(FedError::SecAggDuplicate { .. })));
        assert!(matches!(c.unmask(request), Err(FedError::SecAggPhase { .. })));
    }
    let outcome = server.finish().unwrap();
    let clients_ids: Vec<u64> = (0..n).collect();
    assert_eq!(outcome.included, masked_ok.iter().copied().collect::<Vec<_>>());
    assert_eq!(outcome.dropped, vec![tampered_for]);
    assert_eq!(outcome.sum_fixed, expected_sum(&cfg, &clients_ids, &ups, &masked_ok));
}

/// An independent model of the protocol: `Some(included)` when the round can be unmasked, `None`
/// when some secret lacks `threshold` shares (or nothing arrives).
fn model(clients: &[u64], degree: usize, threshold: usize, graph_seed: u64, drops: &Dropouts) -> Option<BTreeSet<u64>> {
    if clients.len() < threshold + 1 {
        return None;
    }
    let graph = neighbour_graph(clients, degree, graph_seed);
    let u2: BTreeSet<u64> = clients.iter().copied().filter(|c| !drops.before_sharing.contains(c)).collect();
    // A sharer with fewer than t sharing neighbours refuses to mask: it drops.
    let refuses = |c: &u64| graph[c].iter().filter(|n| u2.contains(n)).count() < threshold;
    let u3: BTreeSet<u64> = u2.iter().copied().filter(|c| !drops.before_masked_input.contains(c) && !refuses(c)).collect();
    let u4: BTreeSet<u64> = u3.iter().copied().filter(|c| !drops.before_unmask.contains(c)).collect();
    if u3.is_empty() {
        return None;
    }
    let enough = |c: &u64| graph[c].iter().filter(|n| u4.contains(n)).count() >= threshold;
    (u2.iter().all(enough)).then_some(u3)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_dropouts_unmask_exactly_or_fail_typed(
        n in 6u64..20,
        half_degree in 2usize..5,
        seed in any::<u64>(),
        phases in proptest::collection::vec(0u8..12, 20),
    ) {
        // Goal: for any dropout pattern the round either returns exactly the plain sum of the clients
        // the model says are included, or fails with a typed error exactly when the model says the
        // round cannot be unmasked. Each client drops at phase 0, 1 or 2 with probability 1/12 each,
        // which makes both outcomes common (about half the cases each).
        let clients: Vec<u64> = (0..n).map(|c| c * 3 + 1).collect();
        let degree = 2 * half_degree;
        let threshold = half_degree + 1;
        let cfg = config(n, 16, degree, threshold, seed);
        let ups = updates(n as usize, 16, seed);
        let mut drops = Dropouts::default();
        for (c, p) in clients.iter().zip(&phases) {
            match p { 0 => { drops.before_sharing.insert(*c); } 1 => { drops.before_masked_input.insert(*c); } 2 => { drops.before_unmask.insert(*c); } _ => {} }
        }
        let result = run_round(&cfg, &clients, &ups, &drops, seed);
        match (model(&clients, degree, threshold, seed, &drops), result) {
            (Some(included), Ok(outcome)) => {
                prop_assert_eq!(&outcome.included, &included.iter().copied().collect::<Vec<_>>());
                prop_assert_eq!(outcome.sum_fixed, expected_sum(&cfg, &clients, &ups, &included));
            }
            (None, Err(FedError::SecAggTooFewShares { .. } | FedError::SecAggTooFewClients { .. })) => {}
            (expected, got) => prop_assert!(false, "seed {seed}: model {expected:?}, protocol {got:?}"),
        }
    }
}

#[test]
fn bad_parameters_get_typed_errors() {
    // Goal: configs that would break the overflow bound or the threshold's privacy are refused,
    // naming the field.
    let field = |e: FedError| match e {
        FedError::Config { field, .. } => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    let quant = QuantConfig::finest(1.0, 100).unwrap();
    assert_eq!(field(QuantConfig::new(1.0, 18, 10_000).unwrap_err()), "secagg.scale_bits");
    assert_eq!(field(QuantConfig::new(f32::NAN, 10, 10).unwrap_err()), "secagg.clip");
    assert_eq!(field(QuantConfig::new(1.0, 10, 0).unwrap_err()), "secagg.max_clients");
    assert_eq!(field(SecAggConfig::new(0, 0, 4, 3, quant, 1).unwrap_err()), "secagg.vector_len");
    assert_eq!(field(SecAggConfig::new(0, 8, 5, 3, quant, 1).unwrap_err()), "secagg.degree");
    assert_eq!(field(SecAggConfig::new(0, 8, 4, 2, quant, 1).unwrap_err()), "secagg.threshold");
    assert_eq!(field(SecAggConfig::new(0, 8, 4, 5, quant, 1).unwrap_err()), "secagg.threshold");
    // More clients than the quantisation bound admits: refused when the graph is built.
    let small = SecAggConfig::new(0, 8, 4, 3, QuantConfig::finest(1.0, 5).unwrap(), 1).unwrap();
    let clients: Vec<u64> = (0..6).collect();
    let err = run_round(&small, &clients, &updates(6, 8, 1), &Dropouts::default(), 1).unwrap_err();
    assert_eq!(field(err), "secagg.max_clients");
    // A client id beyond the share field.
    let cfg = config(10, 8, 4, 3, 1);
    assert_eq!(field(SecAggClient::new(u64::MAX, &cfg, ChaCha20Rng::seed_from_u64(1)).err().unwrap()), "secagg.client_id");
}

#[test]
fn outcome_does_not_depend_on_thread_count() {
    // Goal: one and two rayon threads give the same bits (clients run in parallel, the server sums
    // masks in parallel). Method: a round with dropouts at every phase under both pool sizes.
    let seed = test_seed(8);
    let n = 30u64;
    let clients: Vec<u64> = (0..n).collect();
    let ups = updates(n as usize, 97, seed);
    let cfg = config(n, 97, 8, 5, seed);
    let drops = Dropouts { before_sharing: BTreeSet::from([3]), before_masked_input: BTreeSet::from([4, 17]), before_unmask: BTreeSet::from([9]) };
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| run_round(&cfg, &clients, &ups, &drops, seed).unwrap())
    };
    let one = run(1);
    assert_eq!(one, run(2));
    assert_eq!(one.dropped, vec![4, 17]);
}

#[test]
fn losing_a_host_with_a_quarter_of_the_round_needs_about_80_neighbours_at_k_10000() {
    // Goal: the parameter guidance for secure rounds over client hosts, on the real neighbour graph.
    // A host that dies takes a quarter of the round's clients at once (its population slice, random
    // positions on the ring). At the default degree 40 / threshold 21 some surviving client keeps
    // fewer than 21 live neighbours, which makes the round impossible to unmask; at degree 80 /
    // threshold 41 none does (configs/fed_hosts_secagg.toml; BENCHMARKS.md has the kill -9 drill).
    let seed = test_seed(42);
    let clients: Vec<u64> = (0..10_000u64).map(|i| i * 10 + 3).collect();
    let dead = |c: u64| c >= 75_000; // the last of four hosts, by slice
    // Over 8 rounds' graphs (the count per graph is small: about one client at degree 40).
    let short = |degree: usize, threshold: usize| -> usize {
        (0..8u64)
            .map(|round| {
                let graph = neighbour_graph(&clients, degree, seed ^ round);
                clients.iter().filter(|&&c| !dead(c)).filter(|c| graph[c].iter().filter(|&&n| !dead(n)).count() < threshold).count()
            })
            .sum()
    };
    let (at_40, at_80) = (short(40, 21), short(80, 41));
    eprintln!("clients left below the threshold over 8 rounds: {at_40} at degree 40, {at_80} at degree 80");
    assert!(at_40 > 0, "degree 40 was expected to leave some client short in some round");
    assert_eq!(at_80, 0, "degree 80 must leave no client short");
}
