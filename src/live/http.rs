//! The live page's HTTP server (axum on the job's tokio runtime).
//!
//! Routes: `/` the page (one self-contained HTML file), `/events` server-sent events (an
//! `update` message with everything the reader has not seen, at most every
//! [`SSE_MIN_INTERVAL`]), `/api/state` the whole state as JSON, `/api/events?after=SEQ` the
//! timeline after an entry, `/metrics` Prometheus text.
//!
//! Ownership: the [`LiveState`] sits behind one mutex in `Shared`; the job's event loop is the
//! only writer (through [`LiveFeed::record`]), and bumps a `watch` version after each event so
//! every SSE stream wakes, takes the lock briefly and builds its own update from its own cursor.
//! Slow readers therefore never hold up the job: they skip versions, not events.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::header;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use rtx_supervisor::JobEvent;
use serde::Deserialize;
use tokio::sync::watch;
use tracing::Instrument as _;

use super::prometheus;
use super::state::{Cursor, JobInfo, LiveState};
use super::LiveError;

/// The fewest time between two SSE messages to one reader (updates in between are merged).
pub const SSE_MIN_INTERVAL: Duration = Duration::from_millis(100);
/// How long [`LiveServer::stop`] leaves readers to receive the final state.
pub const FINAL_FLUSH: Duration = Duration::from_millis(300);

const PAGE: &str = include_str!("page.html");

/// A running live-page server.
#[derive(Debug)]
pub struct LiveServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

/// The writer's handle: the job's event loop records every event here.
#[derive(Clone, Debug)]
pub struct LiveFeed {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<LiveState>,
    version: watch::Sender<u64>,
}

#[derive(Debug, Deserialize)]
struct EventsQuery {
    after: Option<u64>,
}

impl LiveServer {
    /// Binds `addr` (port 0: any free port) and serves the page of `info`'s job on the current
    /// tokio runtime.
    pub async fn start(addr: SocketAddr, info: JobInfo) -> Result<LiveServer, LiveError> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| LiveError::Bind { addr, source })?;
        let bound = listener.local_addr().map_err(|source| LiveError::Bind { addr, source })?;
        let shared = Arc::new(Shared { state: Mutex::new(LiveState::new(info)), version: watch::Sender::new(0) });
        let app = Router::new()
            .route("/", get(page))
            .route("/events", get(events_stream))
            .route("/api/state", get(api_state))
            .route("/api/events", get(api_events))
            .route("/metrics", get(metrics))
            .with_state(shared.clone());
        let span = tracing::info_span!("live_page", addr = %bound);
        let task = tokio::spawn(
            async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::warn!(error = %e, "the live page stopped serving");
                }
            }
            .instrument(span),
        );
        tracing::info!(addr = %bound, "live page serving");
        Ok(LiveServer { addr: bound, shared, task })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The handle the event loop records events through.
    pub fn feed(&self) -> LiveFeed {
        LiveFeed { shared: self.shared.clone() }
    }

    /// Leaves readers [`FINAL_FLUSH`] to see the final state, then stops serving.
    pub async fn stop(self) {
        tokio::time::sleep(FINAL_FLUSH).await;
        self.task.abort();
    }
}

impl LiveFeed {
    /// Folds `event` (arrived `t` seconds after launch) into the state and wakes the readers.
    pub fn record(&self, event: &JobEvent, t: f64) {
        self.shared.lock().apply(event, t);
        self.shared.version.send_modify(|v| *v += 1);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, LiveState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

async fn page() -> Html<&'static str> {
    Html(PAGE)
}

async fn api_state(State(shared): State<Arc<Shared>>) -> Response {
    let snapshot = shared.lock().snapshot();
    Json(snapshot).into_response()
}

async fn api_events(State(shared): State<Arc<Shared>>, Query(query): Query<EventsQuery>) -> Response {
    let entries = shared.lock().timeline_after(query.after.unwrap_or(0));
    Json(entries).into_response()
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let text = prometheus::render(&shared.lock());
    ([(header::CONTENT_TYPE, prometheus::CONTENT_TYPE)], text).into_response()
}

async fn events_stream(State(shared): State<Arc<Shared>>) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let version = shared.version.subscribe();
    let start = (shared, version, Cursor::default(), true);
    let updates = stream::unfold(start, |(shared, mut version, cursor, first)| async move {
        if !first {
            tokio::time::sleep(SSE_MIN_INTERVAL).await;
            // The feed outlives every stream (the router holds it), so this ends only with the server.
            version.changed().await.ok()?;
        }
        version.borrow_and_update();
        let (update, next) = shared.lock().update_since(cursor);
        let event = match serde_json::to_string(&update) {
            Ok(json) => Event::default().event("update").data(json),
            Err(e) => Event::default().event("error").data(e.to_string()),
        };
        Some((Ok(event), (shared, version, next, false)))
    });
    Sse::new(updates).keep_alive(KeepAlive::default())
}
