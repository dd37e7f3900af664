//! `rtx bench actors`: the round trip of an actor call, in-process (a request/reply through a
//! bounded mailbox on another tokio task) and across processes (an `ask` over a QUIC link on
//! loopback to a child `rtx bench actors --serve` process), as medians over `--calls` calls.
//! Printed against the published figure of Ray's synchronous actor call (~500 µs).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use rtx_actors::{spawn, Actor, Context, Link, LinkListener, LinkOptions, Reply};
use serde_json::json;

/// Arguments of `rtx bench actors`.
#[derive(clap::Args, Debug, Clone)]
pub struct ActorsArgs {
    /// Calls to time (after 200 warm-up calls).
    #[arg(long, default_value_t = 5000)]
    pub calls: usize,
    /// Internal: serve echo calls on a link and print the address (the peer process).
    #[arg(long, hide = true)]
    pub serve: bool,
}

struct Echo;

impl Actor for Echo {
    type Msg = (u64, Reply<u64>);
    async fn handle(&mut self, (v, reply): (u64, Reply<u64>), _ctx: &mut Context<(u64, Reply<u64>)>) -> rtx_actors::Result<()> {
        reply.send(v + 1);
        Ok(())
    }
}

/// Runs the benchmark (or the peer side).
pub(super) fn run(args: &ActorsArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    if args.serve {
        return runtime.block_on(serve());
    }
    runtime.block_on(async {
        let warm = 200;
        let (echo, _handle) = spawn("echo", Echo, 64);
        let mut local = Vec::with_capacity(args.calls);
        for i in 0..(warm + args.calls) as u64 {
            let t = Instant::now();
            let v = echo.ask(|r| (i, r)).await?;
            if v != i + 1 {
                return Err(anyhow!("echo answered {v} to {i}"));
            }
            if i >= warm as u64 {
                local.push(t.elapsed());
            }
        }
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe).args(["bench", "actors", "--serve"]).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().context("start the peer process")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("no peer stdout"))?).read_line(&mut line)?;
        let addr = line.trim().parse().with_context(|| format!("peer printed {line:?}"))?;
        let (link, _inbound) = Link::dial(addr, LinkOptions::default()).await?;
        let remote = link.remote::<u64>("echo");
        let mut cross = Vec::with_capacity(args.calls);
        for i in 0..(warm + args.calls) as u64 {
            let t = Instant::now();
            let v: u64 = remote.ask(&i, Duration::from_secs(10)).await?;
            if v != i + 1 {
                return Err(anyhow!("remote echo answered {v} to {i}"));
            }
            if i >= warm as u64 {
                cross.push(t.elapsed());
            }
        }
        link.close("bench done");
        let _ = child.kill();
        let _ = child.wait();
        let (l, c) = (median_us(&mut local), median_us(&mut cross));
        super::emit(json!({ "bench": "actors", "calls": args.calls, "in_process_median_us": l, "cross_process_quic_median_us": c, "ray_sync_call_us": 497.0, "ratio_vs_ray": c / 497.0, "bar_us": 100.0 }));
        Ok(())
    })
}

async fn serve() -> anyhow::Result<()> {
    let listener = LinkListener::bind("127.0.0.1:0".parse()?, LinkOptions::default())?;
    #[allow(clippy::print_stdout)]
    {
        println!("{}", listener.local_addr()?);
    }
    let (_link, mut inbound) = listener.accept().await.ok_or_else(|| anyhow!("no peer"))?;
    while let Some(msg) = inbound.recv().await {
        let v: u64 = msg.decode()?;
        msg.reply(&(v + 1)).await?;
    }
    Ok(())
}

fn median_us(samples: &mut [Duration]) -> f64 {
    samples.sort();
    samples.get(samples.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}
