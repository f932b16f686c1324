//! Running the server: the accept loop with graceful shutdown, and an in-process
//! server for tests.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use ds4_tokenizer::Tokenizer;

use crate::config::ServerConfig;
use crate::engine::EngineBackend;
use crate::http::router;
use crate::worker::{spawn_worker, Shared};

/// Serves until `shutdown` resolves, then stops the worker (queued jobs get 503, the
/// running one stops) and waits for open connections to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(shared.clone());
    let sh = shared.clone();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            sh.begin_shutdown();
        })
        .await
}

/// A server on 127.0.0.1 with an ephemeral port, on its own runtime thread.
pub struct TestServer {
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    worker: Option<JoinHandle<()>>,
}

impl TestServer {
    pub fn start(
        cfg: ServerConfig,
        tok: Arc<Tokenizer>,
        engine: Box<dyn EngineBackend>,
    ) -> TestServer {
        let shared = Shared::new(cfg, tok);
        let worker = spawn_worker(shared.clone(), engine);
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let addr = std_listener.local_addr().expect("local addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let sh = shared.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
                let _ = serve(listener, sh, async move {
                    let _ = rx.await;
                })
                .await;
            });
        });
        TestServer {
            addr,
            shared,
            stop: Some(tx),
            thread: Some(thread),
            worker: Some(worker),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Graceful shutdown; returns once the worker saved the live session.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.shared.begin_shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}
