//! Cluster environment variables: torchrun's (`MASTER_ADDR`, `MASTER_PORT`, `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`) and Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//! `SLURM_NODELIST`/`SLURM_JOB_NODELIST`), so `rtx supervisor` and `rtx worker` drop into
//! existing launch scripts. torchrun's variables win when both are set. The supervisor's host
//! under Slurm is the first node of the node list.
//!
//! The port is `MASTER_PORT` when set. Otherwise, under Slurm, it is derived from the job id
//! ([`slurm_port`]: 29400 + `SLURM_JOB_ID` mod 3000), so two jobs whose first node is the same
//! host do not both take 29400; without either it is [`DEFAULT_PORT`]. Kernel threads per process
//! ([`threads_from_env`]) are `RTX_NUM_THREADS`, else Slurm's `SLURM_CPUS_PER_TASK`.

use crate::error::{Result, SupervisorError};

/// torchrun's default rendezvous port, used when none is given.
pub const DEFAULT_PORT: u16 = 29400;
/// Ports derived from a Slurm job id lie in `DEFAULT_PORT .. DEFAULT_PORT + SLURM_PORT_SPAN`.
pub const SLURM_PORT_SPAN: u16 = 3000;
/// Linux's default ephemeral range starts here (`net.ipv4.ip_local_port_range`): a derived port
/// must stay below it, or a socket bound to port 0 (a worker's collectives endpoint, any
/// client) may already hold it.
const EPHEMERAL_PORTS_START: u16 = 32768;
const _: () = assert!(DEFAULT_PORT as u32 + SLURM_PORT_SPAN as u32 <= EPHEMERAL_PORTS_START as u32);

/// What the environment says about this process's place in the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterEnv {
    /// Which convention the values came from: `"torchrun"` or `"slurm"`.
    pub source: &'static str,
    /// The supervisor's host.
    pub master_host: String,
    /// The supervisor's port.
    pub master_port: u16,
    /// This process's global index.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Index on this machine.
    pub local_rank: usize,
}

impl ClusterEnv {
    /// `host:port` of the supervisor.
    pub fn master(&self) -> String {
        format!("{}:{}", self.master_host, self.master_port)
    }
}

/// Reads the cluster variables through `get` (usually `std::env::var`); `None` when neither
/// convention is present, an error naming the variable when one is malformed.
pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Option<ClusterEnv>> {
    let parse = |name: &str| -> Result<Option<usize>> {
        match get(name) {
            None => Ok(None),
            Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| SupervisorError::Environment { name: name.into(), value: v.clone(), reason: "not a non-negative integer".into() }),
        }
    };
    let port = match get("MASTER_PORT") {
        Some(v) => v.trim().parse::<u16>().map_err(|_| SupervisorError::Environment { name: "MASTER_PORT".into(), value: v.clone(), reason: "not a port number".into() })?,
        None => match get("SLURM_JOB_ID") {
            Some(v) => slurm_port(v.trim().parse::<u64>().map_err(|_| SupervisorError::Environment { name: "SLURM_JOB_ID".into(), value: v.clone(), reason: "not a job id (a non-negative integer)".into() })?),
            None => DEFAULT_PORT,
        },
    };
    if let Some(host) = get("MASTER_ADDR") {
        let rank = parse("RANK")?.unwrap_or(0);
        let world_size = parse("WORLD_SIZE")?.unwrap_or(1);
        if rank >= world_size {
            return Err(SupervisorError::Environment { name: "RANK".into(), value: rank.to_string(), reason: format!("must be below WORLD_SIZE = {world_size}") });
        }
        return Ok(Some(ClusterEnv { source: "torchrun", master_host: host, master_port: port, rank, world_size, local_rank: parse("LOCAL_RANK")?.unwrap_or(0) }));
    }
    if let Some(rank) = parse("SLURM_PROCID")? {
        let world_size = parse("SLURM_NTASKS")?.unwrap_or(1);
        let list = get("SLURM_JOB_NODELIST").or_else(|| get("SLURM_NODELIST")).ok_or_else(|| SupervisorError::Environment { name: "SLURM_NODELIST".into(), value: String::new(), reason: "missing: needed to find the supervisor's node".into() })?;
        let master_host = first_host(&list).ok_or_else(|| SupervisorError::Environment { name: "SLURM_NODELIST".into(), value: list.clone(), reason: "no host in the list".into() })?;
        return Ok(Some(ClusterEnv { source: "slurm", master_host, master_port: port, rank, world_size, local_rank: parse("SLURM_LOCALID")?.unwrap_or(0) }));
    }
    Ok(None)
}

/// The supervisor's port for Slurm job `job_id` when `MASTER_PORT` is not set:
/// `DEFAULT_PORT + job_id mod SLURM_PORT_SPAN`. Consecutive jobs get consecutive ports, so two
/// jobs sharing a first node collide only when their ids differ by a multiple of 3000 (and both
/// still run); the range stays below Linux's ephemeral ports.
pub fn slurm_port(job_id: u64) -> u16 {
    let offset = (job_id % u64::from(SLURM_PORT_SPAN)) as u16;
    debug_assert!(offset < SLURM_PORT_SPAN);
    DEFAULT_PORT + offset
}

/// Kernel threads this process should use: `RTX_NUM_THREADS`, else `SLURM_CPUS_PER_TASK` (the
/// CPUs Slurm gave each task); `None` when neither is set (the kernels then use every core they
/// see). A value that is not a positive integer is an error naming the variable.
pub fn threads_from_env(get: impl Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    for name in ["RTX_NUM_THREADS", "SLURM_CPUS_PER_TASK"] {
        if let Some(v) = get(name) {
            return match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(Some(n)),
                _ => Err(SupervisorError::Environment { name: name.into(), value: v, reason: "not a positive integer".into() }),
            };
        }
    }
    Ok(None)
}

/// The first host of a Slurm node list: `gpu[03-05,9],cpu1` → `gpu03`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find(',').unwrap_or(list.len());
    let bracket = list.find('[');
    match bracket {
        Some(open) if open < end => {
            let close = list[open..].find(']')? + open;
            let inside = &list[open + 1..close];
            let first = inside.split(',').next()?.split('-').next()?;
            Some(format!("{}{}", &list[..open], first))
        }
        _ => {
            let host = &list[..end];
            (!host.is_empty()).then(|| host.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn torchrun_and_slurm_variables_are_read() {
        let t = from_env(env(&[("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")])).unwrap().unwrap();
        assert_eq!((t.source, t.master().as_str(), t.rank, t.world_size, t.local_rank), ("torchrun", "10.0.0.1:29500", 3, 8, 1));
        let s = from_env(env(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "0"), ("SLURM_JOB_NODELIST", "gpu[03-05,9],cpu1")])).unwrap().unwrap();
        assert_eq!((s.source, s.master().as_str(), s.rank, s.world_size), ("slurm", "gpu03:29400", 2, 4));
        assert_eq!(from_env(env(&[])).unwrap(), None);
    }

    #[test]
    fn malformed_variables_name_the_culprit() {
        let e = from_env(env(&[("MASTER_ADDR", "h"), ("RANK", "x")])).unwrap_err().to_string();
        assert!(e.contains("RANK") && e.contains("non-negative integer"), "{e}");
        let e = from_env(env(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "99999")])).unwrap_err().to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
        let e = from_env(env(&[("MASTER_ADDR", "h"), ("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err().to_string();
        assert!(e.contains("below WORLD_SIZE"), "{e}");
        let e = from_env(env(&[("SLURM_PROCID", "0")])).unwrap_err().to_string();
        assert!(e.contains("SLURM_NODELIST"), "{e}");
        assert_eq!(first_host("node7"), Some("node7".into()));
        assert_eq!(first_host("a[1-3]"), Some("a1".into()));
        let e = from_env(env(&[("SLURM_PROCID", "0"), ("SLURM_JOB_NODELIST", "n1"), ("SLURM_JOB_ID", "12x")])).unwrap_err().to_string();
        assert!(e.contains("SLURM_JOB_ID") && e.contains("12x"), "{e}");
        let e = threads_from_env(env(&[("SLURM_CPUS_PER_TASK", "0")])).unwrap_err().to_string();
        assert!(e.contains("SLURM_CPUS_PER_TASK") && e.contains("positive"), "{e}");
        let e = threads_from_env(env(&[("RTX_NUM_THREADS", "many")])).unwrap_err().to_string();
        assert!(e.contains("RTX_NUM_THREADS"), "{e}");
    }

    /// Two jobs on one first node must not share a port: the port follows `SLURM_JOB_ID`
    /// (consecutive ids, consecutive ports, wrapping within the span), and `MASTER_PORT` wins.
    #[test]
    fn the_slurm_port_follows_the_job_id_and_master_port_wins() {
        fn slurm(job: &str) -> [(&'static str, &str); 4] {
            [("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4"), ("SLURM_JOB_NODELIST", "n[1-2]"), ("SLURM_JOB_ID", job)]
        }
        let port = |job: &str| from_env(env(&slurm(job))).unwrap().unwrap().master_port;
        assert_eq!((port("0"), port("41"), port("42")), (29400, 29441, 29442));
        assert_eq!(port("2999"), 29400 + 2999);
        assert_eq!(port("3000"), 29400);
        assert_eq!(port("123456789"), 29400 + (123_456_789 % 3000) as u16);
        for job in (0..20_000u64).step_by(7) {
            let p = slurm_port(job);
            assert!((DEFAULT_PORT..DEFAULT_PORT + SLURM_PORT_SPAN).contains(&p) && p < EPHEMERAL_PORTS_START, "job {job}: port {p}");
            assert_ne!(p, slurm_port(job + 1), "consecutive jobs {job} and {} share a port", job + 1);
        }
        let mut pinned = slurm("42").to_vec();
        pinned.push(("MASTER_PORT", "31000"));
        assert_eq!(from_env(env(&pinned)).unwrap().unwrap().master_port, 31000);
        // Without a job id (a hand-set SLURM_PROCID) the default stays.
        assert_eq!(from_env(env(&slurm("1")[..3])).unwrap().unwrap().master_port, DEFAULT_PORT);
        // torchrun without MASTER_PORT under a Slurm allocation also takes the job's port.
        assert_eq!(from_env(env(&[("MASTER_ADDR", "h"), ("SLURM_JOB_ID", "7")])).unwrap().unwrap().master_port, 29407);
    }

    /// Threads: `RTX_NUM_THREADS` wins over `SLURM_CPUS_PER_TASK`; neither leaves the choice to
    /// the kernels.
    #[test]
    fn threads_come_from_rtx_num_threads_else_slurm_cpus_per_task() {
        assert_eq!(threads_from_env(env(&[("SLURM_CPUS_PER_TASK", "6")])).unwrap(), Some(6));
        assert_eq!(threads_from_env(env(&[("SLURM_CPUS_PER_TASK", "6"), ("RTX_NUM_THREADS", "2")])).unwrap(), Some(2));
        assert_eq!(threads_from_env(env(&[])).unwrap(), None);
    }
}
