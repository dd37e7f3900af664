//! Console output of a training run: an indicatif progress bar (step, loss, throughput, ETA)
//! when stdout is a terminal, and plain log lines always (through the bar when it is shown, so
//! they do not tear it).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How a run reports progress.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verbosity {
    /// A progress bar when stdout is a terminal, plus log lines.
    #[default]
    Auto,
    /// Log lines only, never a bar.
    Lines,
    /// Nothing on stdout (library and test use).
    Quiet,
}

/// The bar plus the log-line printer.
pub struct Progress {
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl Progress {
    /// A reporter for a run from `start` to `total` steps.
    pub fn new(verbosity: Verbosity, start: u64, total: u64) -> Self {
        let show_bar = verbosity == Verbosity::Auto && std::io::stdout().is_terminal();
        let bar = show_bar.then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stdout());
            let style = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30.cyan/blue} {pos}/{len} {msg} ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            bar.set_style(style);
            bar.set_position(start);
            bar.reset_eta();
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Self { bar, quiet: verbosity == Verbosity::Quiet }
    }

    /// Moves the bar to `step` with the latest loss and throughput.
    pub fn update(&self, step: u64, loss: f64, rate: f64, unit: &str) {
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.set_message(format!("loss {loss:.4} | {} {unit}/s", human(rate)));
        }
    }

    /// Moves the bar to `step` with a free-form message.
    pub fn update_with(&self, step: u64, message: &str) {
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.set_message(message.to_string());
        }
    }

    /// Prints a log line (unless quiet).
    pub fn line(&self, text: &str) {
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(bar) => bar.println(text),
            None => println!("{text}"),
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

/// `12345.6` as `12.3k`, for compact bar messages.
pub fn human(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.1}")
    }
}
