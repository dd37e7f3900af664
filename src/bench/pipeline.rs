//! `rtx bench pipeline`: the **measured** pipeline bubble of GPipe, 1F1B, interleaved 1F1B (2
//! chunks) and ZB-H1 on real stages, at `p = 4` and `m = 8, 16, 32`, next to 1F1B's theory
//! `(p-1)/(m+p-1)` and to the virtual-time prediction of [`rtx_pipelines::schedule::simulate`].
//!
//! Each rank of a `(dp, pp, tp) = (1, p, 1)` mesh is a thread of this process with its own rayon
//! pool of `--threads-per-rank` kernel threads (default `RTX_NUM_THREADS`, else cores / p), over
//! the in-process transport, running [`MeshEngine`] on its [`GptStage`] of a byte-level GPT (8
//! blocks of d_model 256, 4 heads, context 128, micro-batch 4 rows by default: one block's forward
//! takes a few ms; `--pin-cores` pins each rank's kernel threads to cores of their own). After `--warmup` steps it times `--steps` steps from each stage's
//! [`MeshEngine::last_timeline`]: a step's window runs from the first stage's start to the last
//! stage's end of the instruction loop (the optimizer and the gradient reductions after it are
//! left out); a stage is busy while it computes (waiting in the mailbox and sending are not
//! compute) and idle for the rest of the window. Per stage the median over steps is reported; the
//! bubble is idle / window, on the worst stage and averaged over stages.
//!
//! Stages are cut by measured cost (`--partition measured`, the default): before the runs, one
//! rank's pool times the forward and the backward of one micro-batch through the embedding, each
//! block and the head with its loss, and [`rtx_supervisor::plan::partition_layers`] splits the
//! blocks into contiguous virtual stages minimising the largest one (the first paying the
//! embedding, the last the head); `--partition even` gives every virtual stage the same number of
//! blocks. Where the head and embedding cost less than a block, as at the default size, both cut
//! the same way.
//!
//! The prediction simulates the same schedule with the per-virtual-stage compute times measured
//! in the same run (median per instruction kind), so the embedding and the head make stages
//! unequal there as here, and transfers cost nothing. The engine computes input and weight
//! gradients in one pass (see its module doc), so ZB-H1's weight-gradient instructions take no
//! time on it and in this prediction: its measured bubble is that of 1F1B's order with deferred
//! no-ops, not the zero-bubble saving (`rtx bench bubble` predicts that from the W share). A
//! second prediction, `predicted_layers`, simulates it with the calibration's per-layer costs
//! summed over each virtual stage's blocks (stages as cut, no run-time noise, free transfers).

use std::sync::Arc;
use std::time::Instant;

use super::emit;
use super::timing::round3;
use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};
use rtx_pipelines::pipeline::{GptStage, MeshEngine, PipelineConfig, StageModule, StageTimeline, TokenBatch};
use super::bubble::PipelineShape;
use rtx_pipelines::schedule::{simulate, Costs, Op, ScheduleKind};
use rtx_pipelines::{Mesh, MeshGroups, MeshShape};
use rtx_supervisor::plan::{partition_layers, LayerCosts};
use rtx_tensor::nn::{Gpt, GptConfig, Module};
use rtx_tensor::optim::{Sgd, SgdConfig};
use rtx_tensor::{Generator, Tensor};

/// Arguments of `rtx bench pipeline`.
#[derive(clap::Args, Debug, Clone)]
pub struct PipelineArgs {
    /// The model and pipeline shape (stages are rank threads).
    #[command(flatten)]
    pub shape: PipelineShape,
    /// Schedules to run (gpipe, 1f1b, interleaved-2, zb-h1).
    #[arg(long, value_delimiter = ',', default_value = "gpipe,1f1b,interleaved-2,zb-h1")]
    pub schedules: Vec<String>,
    /// Kernel threads per rank (default: RTX_NUM_THREADS, else cores / stages, at least 1).
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// Untimed steps per (schedule, m).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed steps per (schedule, m); medians are reported.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Seeds the model and the token batches.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How blocks are cut into stages: `measured` (balance measured per-layer costs) or `even`.
    #[arg(long, value_enum, default_value_t = Partition::Measured)]
    pub partition: Partition,
    /// Pins rank `r`'s kernel thread `i` to core `r * threads_per_rank + i` (Linux; the
    /// calibration's to cores `0..threads_per_rank`).
    #[arg(long)]
    pub pin_cores: bool,
}

/// How `rtx bench pipeline` cuts the blocks into (virtual) stages.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Partition {
    /// Contiguous ranges minimising the largest measured stage cost (`partition_layers`).
    Measured,
    /// The same number of blocks per virtual stage.
    Even,
}

/// Timed repetitions of the calibration (after one untimed); medians are kept.
const CALIBRATION_REPS: usize = 5;

/// Measured seconds of one micro-batch through each part of the model, forward and backward.
#[derive(Clone, Debug, PartialEq)]
struct LayerTimes {
    forward: LayerCosts,
    backward: LayerCosts,
}

impl LayerTimes {
    /// Forward plus backward, the cost stages are balanced by.
    fn total(&self) -> LayerCosts {
        let blocks = self.forward.blocks.iter().zip(&self.backward.blocks).map(|(f, b)| f + b).collect();
        LayerCosts { embed: self.forward.embed + self.backward.embed, blocks, head: self.forward.head + self.backward.head }
    }

    /// The simulator's costs of the virtual stages holding `layers` (free transfers; the engine's
    /// weight gradients come with the input gradients, so `backward_weight` is zero).
    fn stage_costs(&self, layers: &[std::ops::Range<usize>]) -> Costs {
        let last = layers.len().saturating_sub(1);
        let sum = |c: &LayerCosts| -> Vec<f64> {
            layers.iter().enumerate().map(|(v, r)| c.blocks[r.clone()].iter().sum::<f64>() + if v == 0 { c.embed } else { 0.0 } + if v == last { c.head } else { 0.0 }).collect()
        };
        Costs { forward: sum(&self.forward), backward_input: sum(&self.backward), backward_weight: vec![0.0; layers.len()], p2p: 0.0 }
    }
}

fn parse_schedule(name: &str) -> anyhow::Result<ScheduleKind> {
    Ok(match name {
        "gpipe" => ScheduleKind::GPipe,
        "1f1b" => ScheduleKind::OneFOneB,
        "zb-h1" => ScheduleKind::ZeroBubbleH1,
        other => match other.strip_prefix("interleaved-").map(str::parse::<usize>) {
            Some(Ok(chunks)) => ScheduleKind::Interleaved { chunks },
            _ => anyhow::bail!("unknown schedule {other:?} (gpipe, 1f1b, interleaved-N, zb-h1)"),
        },
    })
}

/// Runs the benchmark: a `setup` line, then one line per (schedule, m).
pub(super) fn run(args: &PipelineArgs) -> anyhow::Result<()> {
    let p = args.shape.stages;
    anyhow::ensure!(p >= 2, "--stages must be at least 2");
    anyhow::ensure!(args.shape.layers > 0 && args.shape.layers.is_multiple_of(2 * p), "--layers {} must be a positive multiple of 2 x stages = {}", args.shape.layers, 2 * p);
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    let kinds = args.schedules.iter().map(|s| parse_schedule(s)).collect::<anyhow::Result<Vec<_>>>()?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let from_env = std::env::var("RTX_NUM_THREADS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0);
    let threads = args.threads_per_rank.or(from_env).unwrap_or((cores / p).max(1));
    // Every kernel sizes its work by the global count: make it the per-rank pool's size.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(threads).build_global();
    anyhow::ensure!(
        rtx_kernels::threading::num_threads() == threads,
        "kernels use {} threads, not {threads}: set RTX_NUM_THREADS={threads}",
        rtx_kernels::threading::num_threads()
    );
    let oversubscribed = p * threads > cores;
    let times = calibrate(args, threads)?;
    let ms = |c: &LayerCosts| serde_json::json!({ "embed": round3(c.embed * 1e3), "blocks": c.blocks.iter().map(|x| round3(x * 1e3)).collect::<Vec<f64>>(), "head": round3(c.head * 1e3) });
    emit(serde_json::json!({
        "bench": "pipeline",
        "line": "setup",
        "model": format!("byte-level GPT, {} blocks of d_model {} heads {} context {}, micro-batch {} rows", args.shape.layers, args.shape.d_model, args.shape.heads, args.shape.context, args.shape.micro_batch),
        "mesh": format!("(dp, pp, tp) = (1, {p}, 1), rank threads over the in-process transport"),
        "cores": cores,
        "ranks": p,
        "threads_per_rank": threads,
        "oversubscribed": oversubscribed,
        "warmup": args.warmup,
        "steps": args.steps,
        "partition": format!("{:?}", args.partition).to_lowercase(),
        "pinned": args.pin_cores,
        "layer_forward_ms": ms(&times.forward),
        "layer_backward_ms": ms(&times.backward),
    }));
    for &m in &args.shape.microbatches {
        for &kind in &kinds {
            let started = Instant::now();
            let layers = match args.partition {
                Partition::Even => layer_ranges(args.shape.layers, p * kind.chunks()),
                Partition::Measured => partition_layers(&times.total(), p * kind.chunks())?,
            };
            let steps = run_mesh(args, kind, m, threads, &layers)?;
            let mut line = summarize(kind, p, m, &steps)?;
            let predicted = simulate(kind, p, m, &times.stage_costs(&layers))?;
            let worst = (0..p).map(|s| predicted.stage_bubble_fraction(s)).fold(0.0, f64::max);
            if let Some(obj) = line.as_object_mut() {
                obj.insert("layers".into(), layers.iter().map(|r| format!("{}..{}", r.start, r.end)).collect::<Vec<String>>().into());
                obj.insert(
                    "predicted_layers".into(),
                    serde_json::json!({
                        "time": "virtual: schedule::simulate with the calibration's per-layer costs summed per virtual stage, free transfers",
                        "step_s": round6(predicted.makespan),
                        "bubble_worst": round4(worst),
                        "bubble_mean": round4(predicted.bubble_fraction()),
                    }),
                );
                obj.insert("cores".into(), cores.into());
                obj.insert("threads_per_rank".into(), threads.into());
                obj.insert("oversubscribed".into(), oversubscribed.into());
                obj.insert("wall_s".into(), round3(started.elapsed().as_secs_f64()).into());
            }
            emit(line);
        }
    }
    Ok(())
}

/// Contiguous, equal layer ranges for `virtual_stages`.
fn layer_ranges(layers: usize, virtual_stages: usize) -> Vec<std::ops::Range<usize>> {
    let each = layers / virtual_stages;
    (0..virtual_stages).map(|v| v * each..(v + 1) * each).collect()
}

fn gpt_config(args: &PipelineArgs) -> GptConfig {
    GptConfig { vocab_size: 256, context: args.shape.context, d_model: args.shape.d_model, n_layers: args.shape.layers, n_heads: args.shape.heads, ..GptConfig::default() }
}

/// Times one micro-batch's forward and backward through each part of the model on a pool of
/// `threads` kernel threads: every block is a virtual stage of a one-rank [`GptStage`], so the
/// first carries the embedding and the last the head and loss; their extra over the median block
/// is the embedding's and the head's cost.
fn calibrate(args: &PipelineArgs, threads: usize) -> anyhow::Result<LayerTimes> {
    let n = args.shape.layers;
    anyhow::ensure!(n > 0, "no blocks to calibrate");
    let pin = args.pin_cores;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("calibrate-k{i}")).start_handler(move |i| pin_kernel_thread(pin, i)).build()?;
    pool.install(|| -> anyhow::Result<LayerTimes> {
        let gpt = Gpt::new(gpt_config(args), &mut Generator::new(args.seed))?;
        let ranges: Vec<std::ops::Range<usize>> = (0..n).map(|i| i..i + 1).collect();
        let stage = GptStage::from_full(gpt, &ranges, 0, 1)?;
        let (rows, t) = (args.shape.micro_batch, args.shape.context);
        let mut g = Generator::new(args.seed ^ 0xCA1B);
        let mut tokens = || Tensor::from_vec((0..rows * t).map(|_| g.below(256) as u32).collect::<Vec<u32>>(), &[rows, t]);
        let batch = TokenBatch { ids: tokens()?, targets: tokens()? };
        let (mut forward, mut backward) = (vec![Vec::new(); n], vec![Vec::new(); n]);
        for rep in 0..=CALIBRATION_REPS {
            let mut rng = Generator::new(args.seed);
            let mut input: Option<Tensor> = None;
            for c in 0..n {
                let t0 = Instant::now();
                let output = stage.forward(c, input.as_ref(), &batch, &mut rng)?;
                let forward_s = t0.elapsed().as_secs_f64();
                let (grad, next) = if c + 1 == n {
                    (None, None)
                } else {
                    let grad = Tensor::from_vec(vec![1e-3f32; output.numel()], output.shape())?;
                    (Some(grad), Some(Tensor::from_vec(output.to_f32_vec()?, output.shape())?.requires_grad(true)))
                };
                let t1 = Instant::now();
                match grad {
                    Some(grad) => output.backward_from(grad, |_| {})?,
                    None => output.backward()?,
                }
                let backward_s = t1.elapsed().as_secs_f64();
                if rep > 0 {
                    forward[c].push(forward_s);
                    backward[c].push(backward_s);
                }
                input = next;
            }
        }
        let split = |samples: Vec<Vec<f64>>| -> LayerCosts {
            let each: Vec<f64> = samples.into_iter().map(median).collect();
            let typical = if n >= 3 { median(each[1..n - 1].to_vec()) } else { each.iter().copied().fold(f64::INFINITY, f64::min) };
            let mut blocks = each.clone();
            blocks[0] = typical;
            blocks[n - 1] = typical;
            let (embed, head) = if n == 1 { (0.0, 0.0) } else { ((each[0] - typical).max(0.0), (each[n - 1] - typical).max(0.0)) };
            LayerCosts { embed, blocks, head }
        };
        Ok(LayerTimes { forward: split(forward), backward: split(backward) })
    })
}

/// Runs `warmup + steps` steps of `kind` over `m` micro-batches with virtual stage `v` holding
/// blocks `layers[v]`; the timed steps' timelines, `[step][stage]`.
fn run_mesh(args: &PipelineArgs, kind: ScheduleKind, m: usize, threads: usize, layers: &[std::ops::Range<usize>]) -> anyhow::Result<Vec<Vec<StageTimeline>>> {
    let p = args.shape.stages;
    let shape = MeshShape { dp: 1, pp: p, tp: 1 };
    let mesh = Mesh::new(shape, p)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let (_net, transports) = InProcessNetwork::new(p);
    anyhow::ensure!(layers.len() == p * kind.chunks(), "{} layer ranges for {} virtual stages", layers.len(), p * kind.chunks());
    let layers = layers.to_vec();
    let gpt_config = gpt_config(args);
    let (rows, t, total_steps, seed) = (args.shape.micro_batch * m, args.shape.context, args.warmup + args.steps, args.seed);
    let mut handles = Vec::with_capacity(p);
    // The endpoints outlive every rank's last step: a rank that dropped its endpoint right after
    // its last send of the final loss broadcast made the peer's pending receive fail as "peer lost".
    // A failing rank drops its own at once, so its peers fail instead of waiting for it.
    let mut endpoints = Vec::with_capacity(p);
    for transport in transports {
        let _guard = runtime.enter();
        let endpoint = Endpoint::new(Arc::new(transport) as Arc<dyn Transport>, CommConfig::default())?;
        let groups = MeshGroups::new(&endpoint, mesh, 0)?;
        let (handle, layers, rank) = (runtime.handle().clone(), layers.clone(), groups.coord.pp);
        let endpoint = Arc::new(std::sync::Mutex::new(Some(endpoint)));
        endpoints.push(Arc::clone(&endpoint));
        let pin = args.pin_cores;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("pp{rank}-k{i}"))
            .start_handler(move |i| pin_kernel_thread(pin, rank * threads + i))
            .build()?;
        handles.push(std::thread::spawn(move || {
            let result = pool.install(|| -> anyhow::Result<Vec<StageTimeline>> {
                let gpt = Gpt::new(gpt_config, &mut Generator::new(seed))?;
                let part = GptStage::from_full(gpt, &layers, groups.coord.pp, p)?;
                let opt = Sgd::new(part.named_parameters(), SgdConfig { lr: 1e-3, ..SgdConfig::default() })?;
                let config = PipelineConfig { schedule: kind, microbatches: m, grad_clip: None, seed };
                let mut engine = MeshEngine::new(part, opt, &groups, handle, config)?;
                let mut timelines = Vec::with_capacity(total_steps);
                for step in 0..total_steps as u64 {
                    // Every rank draws the same batch; the first stage reads the ids, the last the targets.
                    let mut g = Generator::new(seed ^ (step + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    let mut tokens = || Tensor::from_vec((0..rows * t).map(|_| g.below(256) as u32).collect::<Vec<u32>>(), &[rows, t]);
                    let batch = TokenBatch { ids: tokens()?, targets: tokens()? };
                    engine.step(step, &batch.split(m)?, &vec![1.0 / m as f64; m])?;
                    timelines.push(engine.last_timeline().clone());
                }
                Ok(timelines)
            });
            if result.is_err() {
                drop(endpoint.lock().map(|mut e| e.take()));
            }
            result
        }));
    }
    // Join every rank before reporting: the first failure is the cause, the others' "peer lost" follow.
    let results: Vec<anyhow::Result<Vec<StageTimeline>>> =
        handles.into_iter().enumerate().map(|(s, h)| h.join().map_err(|_| anyhow::anyhow!("pipeline rank {s} panicked")).and_then(|r| r)).collect();
    let mut per_stage = Vec::with_capacity(p);
    let mut errors = Vec::new();
    for (s, r) in results.into_iter().enumerate() {
        match r {
            Ok(timelines) => per_stage.push(timelines),
            Err(e) => errors.push(format!("rank {s}: {e:#}")),
        }
    }
    drop(endpoints);
    anyhow::ensure!(errors.is_empty(), "{} m={m}: {}", kind.name(), errors.join("; "));
    Ok((args.warmup..total_steps).map(|step| per_stage.iter().map(|tl| tl[step].clone()).collect()).collect())
}

/// With `pin`, pins the calling thread to `core` (a failure leaves it unpinned, with a warning).
fn pin_kernel_thread(pin: bool, core: usize) {
    if pin && !pin_to_core(core) {
        eprintln!("warning: could not pin a kernel thread to core {core}");
    }
}

/// Pins the calling thread to `core`; false where that failed or is not supported.
#[cfg(target_os = "linux")]
fn pin_to_core(core: usize) -> bool {
    if core >= libc::CPU_SETSIZE as usize {
        return false;
    }
    // SAFETY: `cpu_set_t` is plain data that zeroes validly; CPU_SET writes bit `core` inside it
    // (checked against CPU_SETSIZE above); pid 0 makes sched_setaffinity act on this thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_to_core(_core: usize) -> bool {
    false
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => 0.5 * (xs[n / 2 - 1] + xs[n / 2]),
    }
}

fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// Measured busy/idle per stage and bubble from `steps[step][stage]`, and the prediction.
fn summarize(kind: ScheduleKind, p: usize, m: usize, steps: &[Vec<StageTimeline>]) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(!steps.is_empty() && steps.iter().all(|s| s.len() == p), "timelines of {p} stages per step");
    let secs = |d: std::time::Duration| d.as_secs_f64();
    let (mut windows, mut worst, mut mean) = (Vec::new(), Vec::new(), Vec::new());
    let (mut busy, mut idle, mut waiting, mut sending) = (vec![Vec::new(); p], vec![Vec::new(); p], vec![Vec::new(); p], vec![Vec::new(); p]);
    for stages in steps {
        let first = stages.iter().map(|t| t.started).min().ok_or_else(|| anyhow::anyhow!("no stages"))?;
        let last = stages.iter().map(StageTimeline::ended).max().ok_or_else(|| anyhow::anyhow!("no stages"))?;
        let window = secs(last - first);
        anyhow::ensure!(window > 0.0, "a step took no time");
        let idles: Vec<f64> = stages.iter().map(|t| (window - secs(t.busy())).max(0.0)).collect();
        for (s, t) in stages.iter().enumerate() {
            busy[s].push(secs(t.busy()));
            idle[s].push(idles[s]);
            waiting[s].push(secs(t.waiting()));
            sending[s].push(secs(t.sending()));
        }
        worst.push(idles.iter().copied().fold(0.0, f64::max) / window);
        mean.push(idles.iter().sum::<f64>() / (p as f64 * window));
        windows.push(window);
    }
    let med = |xs: &[Vec<f64>]| xs.iter().map(|v| round6(median(v.clone()))).collect::<Vec<f64>>();
    let costs = measured_costs(kind, p, steps);
    let predicted = simulate(kind, p, m, &costs)?;
    let worst_predicted = (0..p).map(|s| predicted.stage_bubble_fraction(s)).fold(0.0, f64::max);
    let ms = |xs: &[f64]| xs.iter().map(|x| round3(x * 1e3)).collect::<Vec<f64>>();
    Ok(serde_json::json!({
        "bench": "pipeline",
        "time": "measured wall time of real stages (rank threads); 'predicted' is virtual time",
        "schedule": kind.name(),
        "p": p,
        "m": m,
        "steps": steps.len(),
        "step_s": round6(median(windows)),
        "busy_s": med(&busy),
        "idle_s": med(&idle),
        "waiting_s": med(&waiting),
        "sending_s": med(&sending),
        "bubble_worst": round4(median(worst)),
        "bubble_mean": round4(median(mean)),
        "theory_1f1b": round4((p - 1) as f64 / (m + p - 1) as f64),
        "predicted": {
            "time": "virtual: schedule::simulate with this run's median compute per instruction and virtual stage, free transfers",
            "step_s": round6(predicted.makespan),
            "bubble_worst": round4(worst_predicted),
            "bubble_mean": round4(predicted.bubble_fraction()),
        },
        "forward_ms": ms(&costs.forward),
        "backward_ms": ms(&costs.backward_input.iter().zip(&costs.backward_weight).map(|(b, w)| b + w).collect::<Vec<f64>>()),
    }))
}

/// Median compute seconds per virtual stage of forwards and of backwards (`Backward` or
/// `BackwardInput`; `BackwardWeight` separately), over every timed step and micro-batch.
fn measured_costs(kind: ScheduleKind, p: usize, steps: &[Vec<StageTimeline>]) -> Costs {
    let virtual_stages = p * kind.chunks();
    let mut samples = vec![[Vec::new(), Vec::new(), Vec::new()]; virtual_stages];
    for stages in steps {
        for (s, t) in stages.iter().enumerate() {
            for e in &t.events {
                let which = match e.instr.op {
                    Op::Forward => 0,
                    Op::Backward | Op::BackwardInput => 1,
                    Op::BackwardWeight => 2,
                };
                if let Some(v) = samples.get_mut(e.instr.virtual_stage(p, s)) {
                    v[which].push(e.compute().as_secs_f64());
                }
            }
        }
    }
    let table = |which: usize| samples.iter().map(|v| median(v[which].clone())).collect::<Vec<f64>>();
    Costs { forward: table(0), backward_input: table(1), backward_weight: table(2), p2p: 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_real_pipeline_reports_every_stage_and_a_prediction() {
        // Goal: a real 4-stage 1F1B run (tiny GPT, 1 kernel thread per rank) yields one timeline
        // per stage and step, busy + idle = the step window on every stage, a bubble inside
        // (0, 1), and a prediction from the same run's costs that has the right shape.
        let args = PipelineArgs {
            shape: PipelineShape { d_model: 32, heads: 2, context: 16, micro_batch: 2, layers: 8, stages: 4, microbatches: vec![4] },
            schedules: vec!["1f1b".into()],
            threads_per_rank: Some(1),
            warmup: 1,
            steps: 2,
            seed: 3,
            partition: Partition::Measured,
            pin_cores: true,
        };
        let times = calibrate(&args, 1).unwrap();
        assert!(times.forward.blocks.len() == 8 && times.forward.blocks.iter().chain(&times.backward.blocks).all(|&x| x > 0.0), "{times:?}");
        let layers = partition_layers(&times.total(), 4).unwrap();
        assert_eq!(layers.len(), 4);
        let steps = run_mesh(&args, ScheduleKind::OneFOneB, 4, 1, &layers).unwrap();
        assert_eq!(steps.len(), 2);
        assert!(steps.iter().all(|s| s.len() == 4 && s.iter().all(|t| t.events.len() == 8)));
        let line = summarize(ScheduleKind::OneFOneB, 4, 4, &steps).unwrap();
        eprintln!("{line}");
        let f = |k: &str| line[k].as_f64().unwrap();
        for s in 0..4 {
            let (busy, idle) = (line["busy_s"][s].as_f64().unwrap(), line["idle_s"][s].as_f64().unwrap());
            assert!(busy > 0.0 && idle >= 0.0, "stage {s}: busy {busy} idle {idle}");
        }
        assert!(f("bubble_mean") > 0.0 && f("bubble_mean") <= f("bubble_worst") && f("bubble_worst") < 1.0);
        assert_eq!(f("theory_1f1b"), round4(3.0 / 7.0));
        let predicted = line["predicted"]["bubble_mean"].as_f64().unwrap();
        assert!(predicted > 0.0 && predicted < 1.0, "predicted {predicted}");
        assert_eq!(line["forward_ms"].as_array().unwrap().len(), 4);
    }

    #[test]
    fn measured_costs_cut_stages_and_sum_into_the_simulators_costs() {
        // Goal: a head costing 4/3 of a block moves a block off the last of two stages (the even
        // cut would make it the slowest: 10 against 6.25; this one 9.25 against 7), and each
        // virtual stage's simulated cost is its blocks' sum plus the embedding on the first and
        // the head on the last.
        let forward = LayerCosts { embed: 0.25, blocks: vec![1.0; 4], head: 3.0 };
        let backward = LayerCosts { embed: 0.0, blocks: vec![2.0; 4], head: 1.0 };
        let times = LayerTimes { forward, backward };
        let layers = partition_layers(&times.total(), 2).unwrap();
        assert_eq!(layers, vec![0..3, 3..4]);
        let costs = times.stage_costs(&layers);
        assert_eq!(costs.forward, vec![3.25, 4.0]);
        assert_eq!(costs.backward_input, vec![6.0, 3.0]);
        assert_eq!(costs.backward_weight, vec![0.0, 0.0]);
        assert_eq!(layer_ranges(4, 2), vec![0..2, 2..4]);
    }

    #[test]
    fn schedule_names_parse_and_unknown_ones_are_refused() {
        assert_eq!(parse_schedule("interleaved-2").unwrap(), ScheduleKind::Interleaved { chunks: 2 });
        assert_eq!(parse_schedule("zb-h1").unwrap(), ScheduleKind::ZeroBubbleH1);
        assert!(parse_schedule("zb-v").is_err());
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved { chunks: 2 }, ScheduleKind::ZeroBubbleH1] {
            assert_eq!(parse_schedule(&kind.name()).unwrap(), kind);
        }
    }
}
