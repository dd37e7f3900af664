//! Cluster environment variables: torchrun's (`MASTER_ADDR`, `MASTER_PORT`, `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`) and Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//! `SLURM_NODELIST`/`SLURM_JOB_NODELIST`), so `rtx supervisor` and `rtx worker` drop into
//! existing launch scripts. torchrun's variables win when both are set. The supervisor's host
//! under Slurm is the first node of the node list; its port is `MASTER_PORT` or 29400.

use crate::error::{Result, SupervisorError};

/// torchrun's default rendezvous port, used when none is given.
pub const DEFAULT_PORT: u16 = 29400;

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
        None => DEFAULT_PORT,
        Some(v) => v.trim().parse::<u16>().map_err(|_| SupervisorError::Environment { name: "MASTER_PORT".into(), value: v.clone(), reason: "not a port number".into() })?,
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
    }
}
