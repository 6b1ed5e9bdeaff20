//! The accept loop: HTTP/1.1 connections with a deadline for each request's headers and a cap
//! on how many are open at once.
//!
//! `axum::serve` sets no header deadline and no connection cap: a client that opens a
//! connection and sends nothing, or trickles its header bytes, holds the connection (a task, a
//! buffer, a descriptor) for as long as it likes, and enough such clients exhaust the process's
//! descriptors. Here:
//!
//! - **Header deadline.** hyper's HTTP/1 server, given a timer, closes a connection whose
//!   request headers have not all arrived within the deadline. The clock starts when the
//!   server starts waiting for a request — when the connection opens, and again after each
//!   answer on a kept-alive connection — and is not reset by bytes that arrive: a client that
//!   sends nothing, one that trickles its headers, and an idle kept-alive connection are all
//!   closed at the deadline. The deadline ends with the headers: the body has its own (the
//!   408 of `limits`), and a streamed answer is not bounded.
//! - **Connection cap.** At most `max_connections` connections are served at once. While all
//!   are taken, no more are accepted: a new client waits in the kernel's listen queue until a
//!   connection closes (at the latest at its header deadline, if it is one that sends nothing),
//!   rather than being refused — a client of a busy server waits as it would in the queue.
//!
//! HTTP/2 is not served: clients of an OpenAI-style API and browsers speak HTTP/1.1 to a
//! plain-HTTP server, and a connection whose protocol is still being sniffed would escape the
//! header deadline.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// Limits on the connections the service keeps open.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// How long a request's headers may take to arrive, from when the server starts waiting
    /// for them (the connection opened, or the previous answer ended).
    pub header_timeout: Duration,
    /// Connections served at once; more wait in the listen queue.
    pub max_connections: usize,
}

/// Serves `app` on `listener` until `shutdown` completes; then stops accepting, lets each open
/// connection finish the request it is answering, and returns once every connection is closed.
/// A failed `accept` (a client that left, no descriptor free) is retried.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    let slots = Arc::new(Semaphore::new(max));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            s = Arc::clone(&slots).acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    accept_failed(&e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut stop = stop_rx.clone();
        // The watch's guard is dropped inside: only the wake-up crosses the await below.
        let stopping = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        tokio::spawn(async move {
            // Held until the connection is closed: the cap counts open connections.
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                // A closed connection, a client that left or a header deadline passed: nothing
                // to tell anyone (the client is gone).
                _ = conn.as_mut() => {}
                () = stopping => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every slot back: every connection closed.
    let all = u32::try_from(max).unwrap_or(u32::MAX);
    let _ = slots.acquire_many(all).await;
}

/// After a failed `accept`: a connection that failed before it was accepted costs nothing; out
/// of descriptors (or memory), wait a little for some to be freed instead of spinning.
async fn accept_failed(e: &std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::ConnectionRefused
    ) {
        return;
    }
    eprintln!("molt serve: accepting a connection failed: {e}; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
