//! A service on the tiny ladder for the server test binaries (`tests/server.rs`,
//! `tests/server_openai.rs`), bound to 127.0.0.1:0, one at a time. Included by path from those
//! two only, so the other test binaries do not build it.

use std::net::SocketAddr;
use std::time::Duration;

use molt::session::SessionOptions;
use molt_server::{Server, ServerConfig};

use crate::common;

/// The tests run one at a time: the resident-set test measures the whole process, and a
/// rung's context cost is measured at load as the change in the process's anonymous memory,
/// which another test's server loading at the same moment would distort.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Held for the length of a test that starts a server.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}

/// A running service and the means to stop it.
pub struct Running {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Stops the service and waits for it (at most 30 s).
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("server stops")
                .unwrap();
        }
    }
}

/// The request loop the harness forces on every service it starts: `MOLT_TEST_PARALLEL=N`
/// (N > 1) runs the same test bodies against the continuous-batching loop with N sequences,
/// `MOLT_TEST_PARALLEL=1` against the one-at-a-time loop; unset, each test gets the
/// configuration's default. Read by the test harness only, never by the library.
pub fn forced_parallel() -> Option<usize> {
    std::env::var("MOLT_TEST_PARALLEL")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &usize| n >= 1)
}

/// Starts a service on the tiny ladder with its shipped projectors, the configuration changed
/// by `edit` first (a test that sets `parallel` itself keeps its choice).
pub async fn start(edit: impl FnOnce(&mut ServerConfig)) -> Running {
    let mut config = ServerConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        context: common::cfg_server(),
        session: SessionOptions {
            projector_dirs: vec![common::tiny_projectors().clone()],
            // This process is the client as well as the server: its anonymous memory grows with
            // the streamed events the test keeps, so observing it would charge the client's
            // buffers to the rung. The tiny rungs sit ~0.5 MiB apart; the policy must work from
            // the costs measured at load, which the status reports and the tests cut between.
            observe_footprint: false,
            ..SessionOptions::default()
        },
        trace_dirs: vec![],
        ..ServerConfig::default()
    };
    if let Some(n) = forced_parallel() {
        config.parallel = n;
    }
    edit(&mut config);
    let server = Server::start(common::tiny_ladder().clone(), config)
        .await
        .unwrap();
    assert!(
        server.engine_status().routes.iter().all(|r| r.ready),
        "every tiny route has a projector: {:?}",
        server.engine_status().routes
    );
    let addr = server.local_addr();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        server
            .serve(async {
                let _ = rx.await;
            })
            .await
            .unwrap();
    });
    Running {
        addr,
        stop: Some(tx),
        task: Some(task),
    }
}
