//! The actor core: an [`Actor`] owns its state and handles one message at a time from a bounded
//! mailbox; [`ActorRef`] is the only way in. A full mailbox makes [`ActorRef::send`] wait (the
//! back-pressure) and [`ActorRef::try_send`] fail with `MailboxFull`; nothing queues without bound.
//!
//! [`spawn`] runs the actor as a tokio task and returns an [`ActorHandle`] whose [`ActorHandle::join`]
//! tells the supervisor how the actor ended ([`Exit`]): all senders gone or asked to stop (normal),
//! a handler error (failed), or a panic. A panic is caught at the task boundary and reported, never
//! propagated into the supervisor.
//!
//! Requests are messages that carry a [`Reply`]: [`ActorRef::ask`] builds the message around a
//! fresh reply port and waits for the answer; an actor that drops the port unanswered gives the
//! caller `NoReply` instead of a hang.

use std::future::Future;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::error::{ActorError, Result};

/// Default mailbox capacity, in messages.
pub const DEFAULT_MAILBOX: usize = 64;

/// An actor: state plus a message handler.
pub trait Actor: Send + 'static {
    /// The messages the actor accepts.
    type Msg: Send + 'static;

    /// Handles one message. An error stops the actor with [`Exit::Failed`].
    fn handle(&mut self, msg: Self::Msg, ctx: &mut Context<Self::Msg>) -> impl Future<Output = Result<()>> + Send;

    /// Runs once before the first message. An error stops the actor with [`Exit::Failed`].
    fn started(&mut self, _ctx: &mut Context<Self::Msg>) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }

    /// Runs once after the last message, whatever the reason (not after a panic).
    fn stopped(&mut self) {}
}

/// What a handler can do besides handling: reach itself, or stop. It holds only a weak
/// reference, so an actor whose outside references are all dropped still ends.
pub struct Context<M> {
    name: std::sync::Arc<str>,
    weak: mpsc::WeakSender<M>,
    capacity: usize,
    stop: bool,
}

/// How an actor ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exit {
    /// It asked to stop, or every reference to it was dropped.
    Normal,
    /// A handler returned an error.
    Failed(String),
    /// A handler panicked.
    Panicked(String),
}

/// A reference to a running actor; cheap to clone.
pub struct ActorRef<M> {
    name: std::sync::Arc<str>,
    tx: mpsc::Sender<M>,
    capacity: usize,
}

/// The reply port of a request.
pub struct Reply<T>(oneshot::Sender<T>);

/// Owned by the actor's supervisor: waits for the actor to end.
pub struct ActorHandle {
    name: String,
    task: JoinHandle<Exit>,
}

impl<M> Clone for ActorRef<M> {
    fn clone(&self) -> Self {
        ActorRef { name: self.name.clone(), tx: self.tx.clone(), capacity: self.capacity }
    }
}

impl<M> std::fmt::Debug for ActorRef<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActorRef").field("name", &self.name).field("capacity", &self.capacity).finish()
    }
}

impl<M: Send + 'static> ActorRef<M> {
    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Delivers `msg`, waiting while the mailbox is full.
    pub async fn send(&self, msg: M) -> Result<()> {
        self.tx.send(msg).await.map_err(|_| ActorError::Stopped { name: self.name.to_string() })
    }

    /// Delivers `msg` now, or fails with `MailboxFull` / `Stopped`.
    pub fn try_send(&self, msg: M) -> Result<()> {
        self.tx.try_send(msg).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ActorError::MailboxFull { name: self.name.to_string(), capacity: self.capacity },
            mpsc::error::TrySendError::Closed(_) => ActorError::Stopped { name: self.name.to_string() },
        })
    }

    /// Delivers `msg` from a thread outside the tokio runtime, blocking while the mailbox is full.
    pub fn blocking_send(&self, msg: M) -> Result<()> {
        self.tx.blocking_send(msg).map_err(|_| ActorError::Stopped { name: self.name.to_string() })
    }

    /// Sends the request `make(reply)` and waits for the answer.
    pub async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> M) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.send(make(Reply(tx))).await?;
        rx.await.map_err(|_| ActorError::NoReply { name: self.name.to_string() })
    }

    /// Whether the actor has stopped.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

impl<T> Reply<T> {
    /// Answers the request; an answer to a caller that gave up is dropped.
    pub fn send(self, value: T) {
        let _ = self.0.send(value);
    }
}

impl<T> std::fmt::Debug for Reply<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reply")
    }
}

impl<M: Send + 'static> Context<M> {
    /// A reference to the running actor itself; `None` once every outside reference is gone.
    pub fn myself(&self) -> Option<ActorRef<M>> {
        self.weak.upgrade().map(|tx| ActorRef { name: self.name.clone(), tx, capacity: self.capacity })
    }

    /// Stops the actor after the current message (with [`Exit::Normal`]).
    pub fn stop(&mut self) {
        self.stop = true;
    }
}

impl ActorHandle {
    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits for the actor to end and says how.
    pub async fn join(self) -> Exit {
        match self.task.await {
            Ok(exit) => exit,
            Err(e) if e.is_panic() => Exit::Panicked(panic_text(e.into_panic())),
            Err(_) => Exit::Failed("task cancelled".into()),
        }
    }

    /// Stops the actor now, between two awaits of its handler.
    pub fn abort(&self) {
        self.task.abort();
    }

    /// Whether the actor has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// Starts `actor` under `name` with a mailbox of `capacity` messages (at least 1) on the current
/// tokio runtime.
pub fn spawn<A: Actor>(name: impl Into<String>, mut actor: A, capacity: usize) -> (ActorRef<A::Msg>, ActorHandle) {
    let name: String = name.into();
    let capacity = capacity.max(1);
    let (tx, mut rx) = mpsc::channel(capacity);
    let shared_name: std::sync::Arc<str> = name.clone().into();
    let mut ctx = Context { name: shared_name.clone(), weak: tx.downgrade(), capacity, stop: false };
    let span = tracing::debug_span!("actor", name = %name);
    let task = tokio::spawn(
        async move {
            let exit = run(&mut actor, &mut rx, &mut ctx).await;
            actor.stopped();
            if let Exit::Failed(reason) = &exit {
                tracing::warn!(%reason, "actor failed");
            }
            exit
        }
        .instrument(span),
    );
    (ActorRef { name: shared_name, tx, capacity }, ActorHandle { name, task })
}

async fn run<A: Actor>(actor: &mut A, rx: &mut mpsc::Receiver<A::Msg>, ctx: &mut Context<A::Msg>) -> Exit {
    if let Err(e) = actor.started(ctx).await {
        return Exit::Failed(e.to_string());
    }
    while let Some(msg) = rx.recv().await {
        if let Err(e) = actor.handle(msg, ctx).await {
            return Exit::Failed(e.to_string());
        }
        if ctx.stop {
            return Exit::Normal;
        }
    }
    Exit::Normal
}

pub(crate) fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counter {
        total: u64,
    }

    enum CounterMsg {
        Add(u64),
        Get(Reply<u64>),
        Fail,
        Panic,
        Stop,
    }

    impl Actor for Counter {
        type Msg = CounterMsg;
        async fn handle(&mut self, msg: CounterMsg, ctx: &mut Context<CounterMsg>) -> Result<()> {
            match msg {
                CounterMsg::Add(n) => self.total += n,
                CounterMsg::Get(reply) => reply.send(self.total),
                CounterMsg::Fail => return Err(ActorError::Failed { name: "counter".into(), reason: "asked to fail".into() }),
                CounterMsg::Panic => panic!("asked to panic"),
                CounterMsg::Stop => ctx.stop(),
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn messages_are_handled_in_order_and_asks_answer() {
        let (r, handle) = spawn("counter", Counter { total: 0 }, 4);
        for i in 1..=10 {
            r.send(CounterMsg::Add(i)).await.unwrap();
        }
        assert_eq!(r.ask(CounterMsg::Get).await.unwrap(), 55);
        r.send(CounterMsg::Stop).await.unwrap();
        assert_eq!(handle.join().await, Exit::Normal);
        assert!(matches!(r.send(CounterMsg::Add(1)).await, Err(ActorError::Stopped { .. })));
    }

    #[tokio::test]
    async fn dropping_every_reference_ends_the_actor() {
        let (r, handle) = spawn("counter", Counter { total: 0 }, 4);
        r.send(CounterMsg::Add(1)).await.unwrap();
        drop(r);
        assert_eq!(handle.join().await, Exit::Normal);
    }

    #[tokio::test]
    async fn failures_and_panics_reach_the_supervisor() {
        let (r, handle) = spawn("counter", Counter { total: 0 }, 4);
        r.send(CounterMsg::Fail).await.unwrap();
        assert!(matches!(handle.join().await, Exit::Failed(reason) if reason.contains("asked to fail")));
        let (r, handle) = spawn("counter", Counter { total: 0 }, 4);
        r.send(CounterMsg::Panic).await.unwrap();
        assert_eq!(handle.join().await, Exit::Panicked("asked to panic".into()));
    }

    #[tokio::test]
    async fn a_full_mailbox_pushes_back() {
        struct Slow(tokio::sync::watch::Receiver<bool>);
        impl Actor for Slow {
            type Msg = u32;
            async fn handle(&mut self, _msg: u32, _ctx: &mut Context<u32>) -> Result<()> {
                let _ = self.0.wait_for(|go| *go).await;
                Ok(())
            }
        }
        let (go_tx, go_rx) = tokio::sync::watch::channel(false);
        let (r, _handle) = spawn("slow", Slow(go_rx), 2);
        // One message is being handled (blocked), two fill the mailbox, the next one is refused.
        r.send(0).await.unwrap();
        tokio::task::yield_now().await;
        r.send(1).await.unwrap();
        r.send(2).await.unwrap();
        assert!(matches!(r.try_send(3), Err(ActorError::MailboxFull { capacity: 2, .. })));
        go_tx.send(true).unwrap();
        r.send(3).await.unwrap();
    }
}
