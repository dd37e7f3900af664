//! `metrics.jsonl`: one JSON object per line, appended as training goes.
//!
//! A record is a training log line (`loss`, `lr`, throughput, `feature_std` for I-JEPA), an
//! evaluation (`val_loss`, `val_acc`), a frozen-feature evaluation (`probe_acc`, `knn_acc` of
//! `probe_readout`, every readout's in `probe_readouts`, `pixel_probe_acc`) or the final test
//! result (`test_loss`, `test_acc`); fields that do not apply are left out. `wall_s` (seconds since the run or resume started) is the only non-deterministic
//! field, and nothing reads it back into training. On resume, records past the checkpoint's step
//! are dropped so the file describes one consistent run.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricRecord {
    /// Optimizer steps completed.
    pub step: u64,
    /// Mean training loss over the steps since the previous log line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Learning rate of the last step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Global gradient norm of the last step (before clipping), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Training images per second since the previous log line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_s: Option<f64>,
    /// Training tokens per second since the previous log line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Validation loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Validation accuracy (classification).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_acc: Option<f64>,
    /// Workers in the group that committed the step (`rtx launch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world: Option<usize>,
    /// Membership generation of that group (`rtx launch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// Test loss (final evaluation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_loss: Option<f64>,
    /// Test accuracy (final evaluation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_acc: Option<f64>,
    /// I-JEPA collapse monitor: mean over feature dimensions of the standard deviation across
    /// the batch of the pooled encoder features (last step of the log interval).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature_std: Option<f64>,
    /// Linear-probe test accuracy on frozen encoder features (I-JEPA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_acc: Option<f64>,
    /// k-NN test accuracy on frozen encoder features (I-JEPA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub knn_acc: Option<f64>,
    /// Linear-probe test accuracy on raw pixels, trained the same way (the baseline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pixel_probe_acc: Option<f64>,
    /// The readout (`[jepa] probe_features`, the first listed) `probe_acc` and `knn_acc` are of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_readout: Option<String>,
    /// Every readout's accuracies of this evaluation, in the config's order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probe_readouts: Vec<ReadoutMetric>,
    /// Training images the probes used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_train_images: Option<usize>,
    /// V-JEPA: linear-probe test accuracy on the motion direction (first readout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direction_probe_acc: Option<f64>,
    /// V-JEPA: k-NN test accuracy on the motion direction (first readout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direction_knn_acc: Option<f64>,
    /// V-JEPA: attentive-probe test accuracy on the item's class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attentive_probe_acc: Option<f64>,
    /// V-JEPA: attentive-probe test accuracy on the motion direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attentive_direction_acc: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_s: Option<f64>,
}

/// One readout's accuracies in a frozen-feature evaluation (I-JEPA).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReadoutMetric {
    /// Its `[jepa] probe_features` name.
    pub readout: String,
    /// Feature length.
    pub dim: usize,
    /// Linear-probe test accuracy.
    pub probe_acc: f64,
    /// k-NN test accuracy.
    pub knn_acc: f64,
    /// V-JEPA: linear-probe test accuracy on the motion direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direction_probe_acc: Option<f64>,
    /// V-JEPA: k-NN test accuracy on the motion direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direction_knn_acc: Option<f64>,
}

/// Errors of the metrics file.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// Reading or writing the file failed.
    #[error("cannot read or write metrics file {path}", path = .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A line is not a metrics record.
    #[error("metrics file {path} line {line} is not a metrics record", path = .path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

/// Appends records to a `metrics.jsonl`, flushing after each.
pub struct MetricsWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl MetricsWriter {
    /// Starts a fresh file at `path` (truncating any old one).
    pub fn create(path: &Path) -> Result<Self, MetricsError> {
        let file = File::create(path).map_err(|source| io(path, source))?;
        Ok(Self { path: path.to_path_buf(), out: BufWriter::new(file) })
    }

    /// Continues the file at `path` after a resume from step `step`: keeps the records up to
    /// `step`, drops later ones (written after that checkpoint by the interrupted run), appends.
    pub fn resume(path: &Path, step: u64) -> Result<Self, MetricsError> {
        let kept: Vec<MetricRecord> = if path.exists() { read_metrics(path)?.into_iter().filter(|r| r.step <= step).collect() } else { Vec::new() };
        let mut writer = Self::create(path)?;
        for r in &kept {
            writer.write(r)?;
        }
        let file = OpenOptions::new().append(true).open(path).map_err(|source| io(path, source))?;
        writer.out = BufWriter::new(file);
        Ok(writer)
    }

    /// Appends one record.
    pub fn write(&mut self, record: &MetricRecord) -> Result<(), MetricsError> {
        let line = serde_json::to_string(record).map_err(|source| MetricsError::Parse { path: self.path.clone(), line: 0, source })?;
        writeln!(self.out, "{line}").and_then(|()| self.out.flush()).map_err(|source| io(&self.path, source))
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every record of a metrics file (blank lines are skipped).
pub fn read_metrics(path: &Path) -> Result<Vec<MetricRecord>, MetricsError> {
    let file = File::open(path).map_err(|source| io(path, source))?;
    let mut records = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| io(path, source))?;
        if line.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str(&line).map_err(|source| MetricsError::Parse { path: path.to_path_buf(), line: i + 1, source })?;
        records.push(record);
    }
    Ok(records)
}

fn io(path: &Path, source: std::io::Error) -> MetricsError {
    MetricsError::Io { path: path.to_path_buf(), source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_drops_records_past_the_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("metrics.jsonl");
        let mut w = MetricsWriter::create(&path).expect("create");
        for step in [10, 20, 30] {
            w.write(&MetricRecord { step, loss: Some(step as f64), ..Default::default() }).expect("write");
        }
        drop(w);
        let mut w = MetricsWriter::resume(&path, 20).expect("resume");
        w.write(&MetricRecord { step: 25, val_loss: Some(1.5), ..Default::default() }).expect("write");
        drop(w);
        let steps: Vec<u64> = read_metrics(&path).expect("read").iter().map(|r| r.step).collect();
        assert_eq!(steps, [10, 20, 25]);
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.lines().next().is_some_and(|l| l == r#"{"step":10,"loss":10.0}"#), "{text}");
    }
}
