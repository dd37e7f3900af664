//! A link's outgoing side: the queue of envelopes its writer task writes into the stream, and,
//! for links whose stream is a kernel socket (TLS over TCP, [`crate::tls`]), **direct writes**
//! from the sender's own task.
//!
//! Queued (every link): senders put encoded envelopes on a bounded queue; the writer task, on the
//! link's runtime, writes them in order and flushes whenever the queue runs empty (TLS keeps a
//! record it could not hand to a full socket buffered until flushed; QUIC's flush is a no-op).
//!
//! Direct (TLS links): a sender that finds nothing queued and the stream free writes its envelope
//! itself, so the request of a call goes out without waking the link's thread. Measured reason
//! (issue 20): over TCP a write is one system call from the sender's thread, while a hand-off to
//! the writer task is a cross-thread wake-up of several microseconds, a large part of a call that
//! costs about two TCP round trips in all. (Over QUIC the same idea bought nothing: a write there
//! wakes quinn's connection driver on the link's runtime anyway, see `link.rs`.) Order: the writer
//! task holds the stream's lock while it writes, and a count of queued envelopes goes down only
//! once one is written, so a sender writes directly only when every envelope queued before its
//! check is out; envelopes of one sender therefore keep their order, and concurrent senders had
//! no order to keep. Cancellation: a small envelope is written within one poll in practice, but a
//! sender dropped while a write is pending (the socket buffer full) may have written part of an
//! envelope; the stream can then not be resynchronised, so the connection is closed, which fails
//! the link on both ends with `LinkClosed` rather than corrupting the next envelope.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::link::StreamConn;

/// The writing half shared by the writer task and direct senders.
type SharedWriter = tokio::sync::Mutex<Pin<Box<dyn AsyncWrite + Send>>>;

/// Why an envelope could not be sent.
#[derive(Debug)]
pub(crate) enum SendFailed {
    /// The writer task ended (the link is closed).
    Closed,
    /// A direct write failed; the connection is closed.
    Write(std::io::Error),
}

/// The sending side of a link; cheap to clone.
#[derive(Clone)]
pub(crate) struct Outgoing {
    queue: mpsc::Sender<Vec<u8>>,
    direct: Option<Arc<Direct>>,
}

struct Direct {
    writer: SharedWriter,
    /// Envelopes on the queue and not yet written by the writer task.
    queued: AtomicUsize,
    /// Closed when a direct write is cancelled half-way.
    conn: Arc<dyn StreamConn>,
}

impl Outgoing {
    /// A queue of `capacity` envelopes written by a task made of the returned future, which the
    /// caller spawns on the link's runtime. With `direct`, senders may write into `writer`
    /// themselves (see the module doc), and `direct`'s connection is closed if such a write is
    /// cancelled half-way. The future ends when every sender is dropped, or with the error of a
    /// failed write.
    pub(crate) fn new<W>(capacity: usize, writer: W, direct: Option<Arc<dyn StreamConn>>) -> (Outgoing, WriterTask)
    where
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (queue, rx) = mpsc::channel(capacity);
        match direct {
            None => (Outgoing { queue, direct: None }, Box::pin(write_queued(rx, writer))),
            Some(conn) => {
                let direct = Arc::new(Direct { writer: tokio::sync::Mutex::new(Box::pin(writer)), queued: AtomicUsize::new(0), conn });
                (Outgoing { queue, direct: Some(Arc::clone(&direct)) }, Box::pin(write_shared(rx, direct)))
            }
        }
    }

    /// Sends one encoded envelope, waiting while the queue is full.
    pub(crate) async fn send(&self, bytes: Vec<u8>) -> Result<(), SendFailed> {
        let Some(direct) = &self.direct else {
            return self.queue.send(bytes).await.map_err(|_| SendFailed::Closed);
        };
        if direct.queued.load(Ordering::Acquire) == 0 {
            if let Ok(mut writer) = direct.writer.try_lock() {
                let mut torn = TornGuard { conn: &direct.conn, armed: true };
                let written = async {
                    writer.write_all(&bytes).await?;
                    writer.flush().await
                }
                .await;
                torn.armed = false;
                return written.map_err(|e| {
                    direct.conn.close(&format!("direct write failed: {e}"));
                    SendFailed::Write(e)
                });
            }
        }
        direct.queued.fetch_add(1, Ordering::AcqRel);
        self.queue.send(bytes).await.map_err(|_| {
            direct.queued.fetch_sub(1, Ordering::AcqRel);
            SendFailed::Closed
        })
    }

    /// [`send`](Self::send) from a thread outside the runtime: always through the queue.
    pub(crate) fn blocking_send(&self, bytes: Vec<u8>) -> Result<(), SendFailed> {
        if let Some(direct) = &self.direct {
            direct.queued.fetch_add(1, Ordering::AcqRel);
        }
        self.queue.blocking_send(bytes).map_err(|_| {
            if let Some(direct) = &self.direct {
                direct.queued.fetch_sub(1, Ordering::AcqRel);
            }
            SendFailed::Closed
        })
    }
}

/// The writer task's future.
pub(crate) type WriterTask = Pin<Box<dyn std::future::Future<Output = Result<(), std::io::Error>> + Send>>;

async fn write_queued<W: AsyncWrite + Unpin>(mut rx: mpsc::Receiver<Vec<u8>>, mut writer: W) -> Result<(), std::io::Error> {
    while let Some(bytes) = rx.recv().await {
        writer.write_all(&bytes).await?;
        if rx.is_empty() {
            writer.flush().await?;
        }
    }
    let _ = writer.shutdown().await;
    Ok(())
}

async fn write_shared(mut rx: mpsc::Receiver<Vec<u8>>, direct: Arc<Direct>) -> Result<(), std::io::Error> {
    while let Some(bytes) = rx.recv().await {
        let mut writer = direct.writer.lock().await;
        let written = writer.write_all(&bytes).await;
        let flushed = match written {
            Ok(()) if rx.is_empty() => writer.flush().await,
            other => other,
        };
        // Down only once written (under the lock): a direct sender that then sees zero cannot
        // overtake an envelope queued before it looked.
        direct.queued.fetch_sub(1, Ordering::AcqRel);
        flushed?;
    }
    let _ = direct.writer.lock().await.shutdown().await;
    Ok(())
}

/// Closes the connection if a direct write is dropped before it finished.
struct TornGuard<'a> {
    conn: &'a Arc<dyn StreamConn>,
    armed: bool,
}

impl Drop for TornGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.close("a send was cancelled mid-envelope");
        }
    }
}
