//! Secure-aggregation and client-level DP overheads per round, against their plain peers measured in
//! the same run: `cargo bench -p rtx-federated --bench secure` runs K = 10,000 clients with 7,850-float
//! updates (logistic regression 784 -> 10 on Fashion-MNIST) and 0% / 5% dropouts, and prints a JSON
//! report. `RTX_FED_BENCH_K`, `RTX_FED_BENCH_LEN` and `RTX_FED_BENCH_SEED` override the size and seed.
//! Under `cargo test --benches` (no `--bench` argument) it runs once at K = 40 so it cannot rot.
#![allow(clippy::unwrap_used)]

use rtx_federated::secagg::{bench_overheads, SecureBenchConfig};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    let full = std::env::args().any(|a| a == "--bench");
    let config = SecureBenchConfig {
        clients: env_or("RTX_FED_BENCH_K", if full { 10_000 } else { 40 }),
        vector_len: env_or("RTX_FED_BENCH_LEN", if full { 7_850 } else { 785 }),
        dropout_fraction: 0.05,
        seed: env_or("RTX_FED_BENCH_SEED", 42),
    };
    let report = bench_overheads(&config)?;
    anyhow::ensure!(report.exact, "secure aggregation did not reproduce the plain fixed-point sum");
    println!("{}", serde_json::to_string_pretty(&report)?);
    let secure =
        |p: &rtx_federated::secagg::PhaseSeconds| p.client_setup + p.server_setup + p.client_masking + p.server_sum + p.client_unmask + p.server_unmask;
    let server = |p: &rtx_federated::secagg::PhaseSeconds| p.server_setup + p.server_sum + p.server_unmask;
    println!(
        "K {} len {}: plain fixed-point sum {:.3} s; secure aggregation total {:.2} s (server {:.2} s, {:.1}x plain) at 0% dropouts, {:.2} s (server {:.2} s, {:.1}x plain) at {} dropouts; DP mean {:.3} s vs plain mean {:.3} s ({:.2}x)",
        config.clients,
        config.vector_len,
        report.plain_fixed_sum,
        secure(&report.secagg_no_dropout),
        server(&report.secagg_no_dropout),
        server(&report.secagg_no_dropout) / report.plain_fixed_sum,
        secure(&report.secagg_dropout),
        server(&report.secagg_dropout),
        server(&report.secagg_dropout) / report.plain_fixed_sum,
        report.dropped,
        report.dp_mean,
        report.plain_mean,
        report.dp_mean / report.plain_mean,
    );
    Ok(())
}
