//! The live cluster page of `rtx launch --http ADDR` and `rtx supervisor --http ADDR`: members
//! with their mesh coordinates and hosts, the generation history, step, throughput, the loss
//! curve and a timeline of joins, losses, recoveries and checkpoints, updated live over
//! server-sent events; a JSON API (`/api/state`, `/api/events`) and Prometheus text (`/metrics`).
//!
//! [`state`] folds the supervisor's `JobEvent`s into a bounded [`LiveState`] (pure, no IO or
//! clock); [`http`] serves it. The job's event loop (`elastic::follow`) records each event through
//! a [`LiveFeed`]; nothing here decides anything about the job.

pub mod http;
pub mod prometheus;
pub mod state;

use std::net::SocketAddr;
use std::path::PathBuf;

pub use http::{LiveFeed, LiveServer};
pub use state::{JobInfo, LiveState};

/// Errors of the live page.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// The HTTP listener could not be bound (address in use, not local, no permission).
    #[error("cannot serve the live page on {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The bound address could not be written to the output folder.
    #[error("cannot write the live page's address to {path}", path = .path.display())]
    WriteAddr {
        /// `<out>/http.addr`.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Writes `addr` to `<out_dir>/http.addr` (what tests and scripts read to find the page).
pub fn write_addr(out_dir: &std::path::Path, addr: SocketAddr) -> Result<PathBuf, LiveError> {
    let path = out_dir.join("http.addr");
    std::fs::write(&path, format!("{addr}\n")).map_err(|source| LiveError::WriteAddr { path: path.clone(), source })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_taken_address_is_a_typed_error_naming_it() {
        // Goal: binding an address in use fails with `LiveError::Bind` naming the address.
        let info = JobInfo { config: "t".into(), total_steps: 1, unit: "samples".into(), per_step: 1, supervisor: "s".into(), out_dir: "o".into() };
        let first = LiveServer::start("127.0.0.1:0".parse().expect("addr"), info.clone()).await.expect("first bind");
        let err = LiveServer::start(first.addr(), info).await.expect_err("second bind of the same port");
        assert!(matches!(&err, LiveError::Bind { addr, .. } if *addr == first.addr()), "{err:?}");
        assert!(err.to_string().contains(&first.addr().to_string()), "{err}");
    }

    #[test]
    fn an_unwritable_folder_is_a_typed_error_naming_the_file() {
        // Goal: `write_addr` into a folder that does not exist names the file it could not write.
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("absent");
        let err = write_addr(&missing, "127.0.0.1:1".parse().expect("addr")).expect_err("no folder");
        assert!(err.to_string().contains("absent/http.addr"), "{err}");
        let path = write_addr(dir.path(), "127.0.0.1:1".parse().expect("addr")).expect("write");
        assert_eq!(std::fs::read_to_string(path).expect("read"), "127.0.0.1:1\n");
    }
}
