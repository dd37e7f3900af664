//! `rtx plan CONFIG --world N`: the plan a job's `[parallel]` section gives on `N` ranks, without
//! starting anything: the mesh, each rank's coordinate, layers, units and memory estimate, the
//! stage costs, and the predicted bubble of the configured schedule (`--json` for tools).
//!
//! Costs are the static estimate of [`rtx_supervisor::plan::ModelLayout::static_costs`] (forward FLOPs per token from the
//! model's dimensions), not measurements; the bubble is the schedule's closed form. Both are said
//! in the output.

use anyhow::Context as _;
use rtx_supervisor::plan::{self, memory_estimate, predicted_bubble, simulated_bubble, stage_costs, MemoryEstimate, ModelLayout, Plan, PlanInput, Schedule, Unit};
use serde_json::{json, Value};

use crate::cli::PlanArgs;
use crate::config::{Precision, TrainConfig};
use crate::progress::human;

/// How the stage costs were made, as printed.
const COST_MODEL: &str =
    "static estimate from the model's dimensions (forward FLOPs per token: 8·C² + 4·C·F + 4·T·C per block, 2·C·V for the head), not measured";

/// Runs `rtx plan`.
pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let config = TrainConfig::load(&args.config)?;
    let report = report(&config, args.world).with_context(|| format!("config {} on {} ranks", args.config.display(), args.world))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }
    Ok(())
}

/// The plan of `config` on `world` fresh ranks, as JSON (the `--json` output; the text is made
/// from it).
pub fn report(config: &TrainConfig, world: usize) -> anyhow::Result<Value> {
    let mesh = config.mesh(world)?;
    let shape = mesh.shape();
    let p = &config.parallel;
    let bubble = predicted_bubble(p.schedule, shape.pp, p.microbatches, p.chunks());
    let bubble_formula = match p.schedule {
        Schedule::GPipe | Schedule::OneFOneB => "(p-1)/(m+p-1)",
        Schedule::Interleaved => "(p-1)/(v·m+p-1)",
        Schedule::ZbH1 => "(p-1)/(3m+p-1)",
    };
    let mut out = json!({
        "world": world,
        "mesh": { "dp": shape.dp, "pp": shape.pp, "tp": shape.tp },
        "zero": p.zero,
        "schedule": p.schedule.to_string(),
        "microbatches": p.microbatches,
        "virtual_stages": p.chunks(),
        "bubble": bubble,
        "bubble_formula": bubble_formula,
    });
    let Some(layout) = config.model_layout() else {
        // An MLP: data parallelism only, one unit; no per-layer costs or memory model.
        out["ranks"] = mesh.coords().enumerate().map(|(rank, c)| json!({ "rank": rank, "coord": { "dp": c.dp, "pp": c.pp, "tp": c.tp } })).collect();
        out["note"] = json!("memory and stage costs are estimated for GPT models only");
        return Ok(out);
    };
    let costs = layout.static_costs();
    let input = PlanInput {
        generation: 0,
        previous: None,
        members: Vec::new(),
        config: p.clone(),
        model: layout,
        costs: costs.clone(),
        checkpoint: None,
        world,
        committed: None,
        resume_next_step: 0,
    };
    let plan = plan::plan(&input)?;
    let dtype_bytes = match config.precision() {
        Precision::F32 => 4,
        Precision::Bf16 => 2,
    };
    let context = layout.context;
    let tokens = (config.data.batch_size / p.microbatches.max(1) * context) as u64;
    out["cost_model"] = json!(COST_MODEL);
    out["dtype_bytes"] = json!(dtype_bytes);
    out["microbatch_tokens"] = json!(tokens);
    let totals = stage_costs(&costs, &plan.stages);
    let sum: f64 = totals.iter().sum();
    out["stages"] = plan
        .stages
        .iter()
        .zip(&totals)
        .enumerate()
        .map(|(j, (r, cost))| json!({ "stage": j, "rank_pp": j % shape.pp, "layers": [r.start, r.end], "embed": j == 0, "head": j + 1 == plan.stages.len(), "cost_flops_per_token": cost, "share": cost / sum.max(f64::MIN_POSITIVE) }))
        .collect();
    if let Some((mean, worst)) = simulated_bubble(p.schedule, shape.pp, p.microbatches, p.chunks(), &totals) {
        out["bubble_simulated"] = json!({ "mean": mean, "worst_stage": worst, "how": "schedule::simulate with these stage costs, backward = 2 x forward, free transfers" });
    }
    out["ranks"] = ranks(&plan, &layout, dtype_bytes, tokens)?;
    Ok(out)
}

fn ranks(plan: &Plan, layout: &ModelLayout, dtype_bytes: u64, tokens: u64) -> anyhow::Result<Value> {
    let mut out = Vec::new();
    for a in &plan.assignments {
        let m: MemoryEstimate = memory_estimate(plan, a.rank, layout, dtype_bytes, tokens)?;
        let units: Vec<String> = a.units.iter().map(Unit::to_string).collect();
        let tied: Vec<String> = a.shards.iter().filter(|s| s.tied_copy).map(|s| s.shard.to_string()).collect();
        out.push(json!({
            "rank": a.rank,
            "coord": { "dp": a.coord.dp, "pp": a.coord.pp, "tp": a.coord.tp },
            "layers": a.layers.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
            "units": units,
            "tied_embedding_copy": tied,
            "shards": a.shards.iter().map(|s| s.shard.to_string()).collect::<Vec<_>>(),
            "memory_bytes": m,
        }));
    }
    Ok(Value::Array(out))
}

/// The human-readable form of a [`report`].
pub fn text(r: &Value) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let mesh = &r["mesh"];
    let _ = writeln!(
        s,
        "mesh (dp={}, pp={}, tp={}) over {} ranks | zero {} | schedule {} | {} micro-batches",
        mesh["dp"],
        mesh["pp"],
        mesh["tp"],
        r["world"],
        r["zero"],
        r["schedule"].as_str().unwrap_or(""),
        r["microbatches"]
    );
    let _ = writeln!(
        s,
        "predicted bubble: {:.1}% (closed form {} for {}, equal stages)",
        r["bubble"].as_f64().unwrap_or(0.0) * 100.0,
        r["bubble_formula"].as_str().unwrap_or(""),
        r["schedule"].as_str().unwrap_or("")
    );
    if let Some(sim) = r.get("bubble_simulated") {
        let _ = writeln!(
            s,
            "simulated bubble with these stage costs: {:.1}% mean, {:.1}% on the idlest stage (virtual time, backward = 2 x forward, free transfers)",
            sim["mean"].as_f64().unwrap_or(0.0) * 100.0,
            sim["worst_stage"].as_f64().unwrap_or(0.0) * 100.0
        );
    }
    if let Some(note) = r["note"].as_str() {
        let _ = writeln!(s, "{note}");
    }
    if let Some(stages) = r["stages"].as_array() {
        let _ = writeln!(s, "stage costs: {}", r["cost_model"].as_str().unwrap_or(""));
        for st in stages {
            let extra = match (st["embed"].as_bool() == Some(true), st["head"].as_bool() == Some(true)) {
                (true, true) => " + embed + head",
                (true, false) => " + embed",
                (false, true) => " + head",
                _ => "",
            };
            let layers = format!("blocks {}..{}{extra}", st["layers"][0], st["layers"][1]);
            let _ = writeln!(
                s,
                "  stage {} (pp rank {}): {layers:<24} {:>8} FLOP/token  {:>5.1}%",
                st["stage"],
                st["rank_pp"],
                human(st["cost_flops_per_token"].as_f64().unwrap_or(0.0)),
                st["share"].as_f64().unwrap_or(0.0) * 100.0
            );
        }
        let _ = writeln!(
            s,
            "memory per rank: {}-byte parameters, micro-batches of {} tokens; AdamW, Megatron activation formula",
            r["dtype_bytes"], r["microbatch_tokens"]
        );
    }
    let _ = writeln!(
        s,
        "{:>5}  {:<20} {:<12} {:<28} {:>10} {:>10} {:>10} {:>11} {:>10}",
        "rank", "coord", "layers", "units", "params", "grads", "optimizer", "activations", "total"
    );
    for rank in r["ranks"].as_array().into_iter().flatten() {
        let c = &rank["coord"];
        let coord = format!("(dp={}, pp={}, tp={})", c["dp"], c["pp"], c["tp"]);
        let layers: Vec<String> = rank["layers"].as_array().into_iter().flatten().map(|l| format!("{}..{}", l[0], l[1])).collect();
        let mut units: Vec<String> = rank["units"].as_array().into_iter().flatten().filter_map(|u| u.as_str().map(str::to_string)).collect();
        if rank["tied_embedding_copy"].as_array().is_some_and(|t| !t.is_empty()) {
            units.push("embed(copy)".into());
        }
        let units = compact_units(&units);
        let m = &rank["memory_bytes"];
        let b = |k: &str| m[k].as_f64().map_or("-".to_string(), bytes);
        let _ = writeln!(
            s,
            "{:>5}  {coord:<20} {:<12} {units:<28} {:>10} {:>10} {:>10} {:>11} {:>10}",
            rank["rank"].as_u64().unwrap_or(0),
            layers.join(","),
            b("params"),
            b("grads"),
            b("optimizer"),
            b("activations"),
            b("total")
        );
    }
    s
}

/// `embed, block0, block1, block2, head` as `embed, block0-2, head`.
fn compact_units(units: &[String]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(usize, usize)> = None;
    let flush = |run: &mut Option<(usize, usize)>, out: &mut Vec<String>| {
        if let Some((a, b)) = run.take() {
            out.push(if a == b { format!("block{a}") } else { format!("block{a}-{b}") });
        }
    };
    for u in units {
        match u.strip_prefix("block").and_then(|i| i.parse::<usize>().ok()) {
            Some(i) => match run {
                Some((a, b)) if b + 1 == i => run = Some((a, i)),
                _ => {
                    flush(&mut run, &mut out);
                    run = Some((i, i));
                }
            },
            None => {
                flush(&mut run, &mut out);
                out.push(u.clone());
            }
        }
    }
    flush(&mut run, &mut out);
    out.join(",")
}

/// Bytes in KiB/MiB/GiB.
fn bytes(x: f64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = x;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_print_compactly() {
        let u = |v: &[&str]| compact_units(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(u(&["embed", "block0", "block1", "block2", "head"]), "embed,block0-2,head");
        assert_eq!(u(&["block3", "block5", "block6"]), "block3,block5-6");
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(bytes(3.0 * 1024.0 * 1024.0), "3.0 MiB");
    }
}
