//! A stage's measured timeline of one step: for every instruction of its schedule, when it ran and
//! how its wall time splits into compute (forward or backward work), waiting for a message
//! ([`crate::pipeline::Mailbox::take`]) and sending one. [`crate::pipeline::MeshEngine`] records
//! it around its instruction loop and keeps the last step's as [`StageTimeline`]; `rtx bench
//! pipeline` turns the timelines of all stages into busy and idle time and the measured bubble.
//!
//! Decision: this is a measurement, not a protocol decision, so it reads the wall clock
//! (`std::time::Instant`) and nothing depends on it; offsets are from the start of the step's
//! instruction loop, and [`StageTimeline::started`] is kept so the timelines of stages running on
//! threads of one process can be put on one axis.

use std::time::{Duration, Instant};

use crate::schedule::Instr;

/// One executed instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InstrSpan {
    /// What ran.
    pub instr: Instr,
    /// When it began, from [`StageTimeline::started`].
    pub start: Duration,
    /// When it ended, from [`StageTimeline::started`].
    pub end: Duration,
    /// Time spent waiting in the mailbox for its input (activation or output gradient).
    pub waiting: Duration,
    /// Time spent handing its output on (posting it to the send queue; blocked while the queue is full).
    pub sending: Duration,
}

impl InstrSpan {
    /// The rest of its span: forward or backward work (and the engine's bookkeeping around it).
    pub fn compute(&self) -> Duration {
        self.end.saturating_sub(self.start).saturating_sub(self.waiting).saturating_sub(self.sending)
    }
}

/// What one stage did during one step's instruction loop, in wall time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageTimeline {
    /// When the instruction loop began.
    pub started: Instant,
    /// How long the instruction loop took (the first instruction's start to the last one's end).
    pub total: Duration,
    /// The instructions in the order they ran.
    pub events: Vec<InstrSpan>,
}

impl StageTimeline {
    /// A timeline with nothing in it (before the first step).
    pub fn empty() -> StageTimeline {
        StageTimeline { started: Instant::now(), total: Duration::ZERO, events: Vec::new() }
    }

    /// Total compute time.
    pub fn busy(&self) -> Duration {
        self.events.iter().map(InstrSpan::compute).sum()
    }

    /// Total time waiting for messages.
    pub fn waiting(&self) -> Duration {
        self.events.iter().map(|e| e.waiting).sum()
    }

    /// Total time sending messages.
    pub fn sending(&self) -> Duration {
        self.events.iter().map(|e| e.sending).sum()
    }

    /// When the instruction loop ended.
    pub fn ended(&self) -> Instant {
        self.started + self.total
    }
}

/// Builds a [`StageTimeline`] while the engine runs its instructions.
#[derive(Debug)]
pub(crate) struct Recorder {
    started: Instant,
    events: Vec<InstrSpan>,
    current: Option<(Instr, Instant, Duration, Duration)>,
}

impl Recorder {
    /// Starts the clock.
    pub(crate) fn start(capacity: usize) -> Recorder {
        Recorder { started: Instant::now(), events: Vec::with_capacity(capacity), current: None }
    }

    /// `instr` begins now (ending the one before, if still open).
    pub(crate) fn begin(&mut self, instr: Instr) {
        self.end();
        self.current = Some((instr, Instant::now(), Duration::ZERO, Duration::ZERO));
    }

    /// Runs `wait` (a mailbox take) and counts its time as waiting.
    pub(crate) fn waiting<T>(&mut self, wait: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let out = wait();
        if let Some((_, _, waited, _)) = &mut self.current {
            *waited += t0.elapsed();
        }
        out
    }

    /// Runs `send` (a mailbox send) and counts its time as sending.
    pub(crate) fn sending<T>(&mut self, send: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let out = send();
        if let Some((_, _, _, sent)) = &mut self.current {
            *sent += t0.elapsed();
        }
        out
    }

    /// The open instruction ends now.
    pub(crate) fn end(&mut self) {
        if let Some((instr, began, waiting, sending)) = self.current.take() {
            let now = Instant::now();
            self.events.push(InstrSpan { instr, start: began - self.started, end: now - self.started, waiting, sending });
        }
    }

    /// The finished timeline: from the start to the last instruction's end.
    pub(crate) fn finish(mut self) -> StageTimeline {
        self.end();
        let total = self.events.last().map_or(Duration::ZERO, |e| e.end);
        StageTimeline { started: self.started, total, events: self.events }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Op;
    use std::thread::sleep;

    #[test]
    fn splits_each_instruction_into_compute_waiting_and_sending() {
        // Goal: time inside `waiting` and `sending` is attributed to them, the rest of an
        // instruction's span is compute, and the totals add up over instructions in run order.
        let ms = Duration::from_millis;
        let mut rec = Recorder::start(2);
        rec.begin(Instr::new(Op::Forward, 0));
        rec.waiting(|| sleep(ms(30)));
        sleep(ms(20));
        rec.sending(|| sleep(ms(10)));
        rec.begin(Instr::new(Op::Backward, 0));
        sleep(ms(15));
        let t = rec.finish();
        assert_eq!(t.events.iter().map(|e| e.instr).collect::<Vec<_>>(), vec![Instr::new(Op::Forward, 0), Instr::new(Op::Backward, 0)]);
        let (f, b) = (t.events[0], t.events[1]);
        assert!(f.waiting >= ms(30), "waiting {:?}", f.waiting);
        assert!(f.sending >= ms(10), "sending {:?}", f.sending);
        // Lower bounds only (a loaded machine oversleeps); the exact sums below catch time counted twice.
        assert!(f.compute() >= ms(20), "compute {:?}", f.compute());
        assert_eq!((b.waiting, b.sending), (Duration::ZERO, Duration::ZERO));
        assert!(b.compute() >= ms(15));
        assert!(f.end <= b.start && t.total == b.end);
        assert_eq!(t.busy(), f.compute() + b.compute());
        assert_eq!(t.waiting() + t.sending() + t.busy(), f.end - f.start + (b.end - b.start));
        assert!(t.busy() + t.waiting() + t.sending() <= t.total);
    }
}
