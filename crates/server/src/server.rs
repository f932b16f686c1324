//! Running the server: the accept loop (connection limits, graceful shutdown), the
//! loading state answered while the model loads, and an in-process server for tests.
//!
//! #18 item 1: every connection is bounded. A request's headers must arrive within
//! `header_read_timeout` of their first byte, a connection without a request in flight
//! closes `idle_timeout` after its last request (or its accept), and at most `max_connections` stay open: at the cap the longest-idle
//! one is closed to admit the newcomer, so a flood of idle sockets cannot keep `/health`
//! out; only when every connection has a request in flight is the newcomer closed.
//!
//! #19 item 3: the port is bound before the model loads; until [`Startup::ready`] every
//! request gets 503 "loading" (see [`crate::http::loading_response`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::response::Response;
use axum::Router;
use ds4_tokenizer::Tokenizer;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tower_service::Service;

use crate::config::{ConnLimits, ServerConfig};
use crate::engine::EngineBackend;
use crate::http::{loading_response, router};
use crate::log;
use crate::worker::{spawn_worker, Shared};

/// What the server is doing before it serves: the phase and its progress (0..=1),
/// then the ready application.
pub struct Startup {
    phase: Mutex<(&'static str, f64)>,
    ready: OnceLock<(Arc<Shared>, Router)>,
}

impl Startup {
    pub fn new() -> Arc<Startup> {
        Arc::new(Startup {
            phase: Mutex::new(("starting", 0.0)),
            ready: OnceLock::new(),
        })
    }

    /// A server that is ready from the start.
    pub fn ready_with(shared: Arc<Shared>) -> Arc<Startup> {
        let s = Startup::new();
        s.ready(shared);
        s
    }

    /// Records the load phase (`loading`, `uploading`, `warming`) and its fraction done.
    pub fn set_phase(&self, phase: &'static str, progress: f64) {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = (phase, progress.clamp(0.0, 1.0));
    }

    pub fn phase(&self) -> (&'static str, f64) {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Switches every later request to the application.
    pub fn ready(&self, shared: Arc<Shared>) {
        let app = router(shared.clone());
        let _ = self.ready.set((shared, app));
    }

    pub fn shared(&self) -> Option<&Arc<Shared>> {
        self.ready.get().map(|(s, _)| s)
    }

    /// Logs the phase every `every` until ready (a long load shows it is alive).
    pub async fn log_progress(self: Arc<Startup>, every: Duration) {
        let t0 = Instant::now();
        loop {
            tokio::time::sleep(every).await;
            if self.ready.get().is_some() {
                return;
            }
            let (phase, p) = self.phase();
            log!(
                "{phase}: {:.0}% ({:.0} s)",
                p * 100.0,
                t0.elapsed().as_secs_f64()
            );
        }
    }

    async fn handle(self: Arc<Startup>, req: Request) -> Response {
        match self.ready.get() {
            Some((_, app)) => {
                let mut app = app.clone();
                match app.call(req).await {
                    Ok(r) => r,
                    Err(e) => match e {},
                }
            }
            None => {
                let (phase, p) = self.phase();
                loading_response(req.uri().path(), phase, p)
            }
        }
    }
}

/// One open connection, as the accept loop sees it.
struct Conn {
    /// Requests whose response is not finished yet.
    busy: AtomicUsize,
    /// Milliseconds since [`Registry::t0`] of the last request start or response end.
    last: AtomicU64,
    /// 1 + the millisecond the first byte of a request head arrived while idle; 0: none
    /// yet. Starts the header-read deadline.
    head_since: AtomicU64,
    /// Closes the connection (used to make room at the cap).
    close: Notify,
}

/// The open connections, oldest first.
struct Registry {
    t0: Instant,
    next_id: AtomicU64,
    conns: Mutex<BTreeMap<u64, Arc<Conn>>>,
}

impl Registry {
    fn now_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    /// Admits a connection, closing the longest-idle one when at `cap`; `None` when
    /// every open connection is busy.
    fn admit(&self, cap: usize) -> Option<(u64, Arc<Conn>)> {
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if conns.len() >= cap {
            let victim = conns
                .iter()
                .filter(|(_, c)| c.busy.load(Relaxed) == 0)
                .min_by_key(|(_, c)| c.last.load(Relaxed))
                .map(|(&id, _)| id)?;
            if let Some(c) = conns.remove(&victim) {
                c.close.notify_one();
            }
        }
        let id = self.next_id.fetch_add(1, Relaxed);
        let c = Arc::new(Conn {
            busy: AtomicUsize::new(0),
            last: AtomicU64::new(self.now_ms()),
            head_since: AtomicU64::new(0),
            close: Notify::new(),
        });
        conns.insert(id, c.clone());
        Some((id, c))
    }

    fn remove(&self, id: u64) {
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    fn len(&self) -> usize {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Marks its connection busy from the request's start until the response body is
/// finished or dropped.
struct BusyGuard {
    conn: Arc<Conn>,
    reg: Arc<Registry>,
}

impl BusyGuard {
    fn new(conn: Arc<Conn>, reg: Arc<Registry>) -> BusyGuard {
        conn.busy.fetch_add(1, Relaxed);
        conn.head_since.store(0, Relaxed);
        conn.last.store(reg.now_ms(), Relaxed);
        BusyGuard { conn, reg }
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.conn.last.store(self.reg.now_ms(), Relaxed);
        self.conn.busy.fetch_sub(1, Relaxed);
    }
}

/// A response body that holds its connection's [`BusyGuard`].
struct GuardedBody {
    inner: Body,
    _guard: BusyGuard,
}

impl HttpBody for GuardedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A client socket that records when the first byte of a request arrives on an idle
/// connection (hyper's own header timer also runs while a keep-alive connection waits,
/// which would make it an idle timeout too).
struct Tracked {
    io: tokio::net::TcpStream,
    conn: Arc<Conn>,
    reg: Arc<Registry>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        let c = &self.conn;
        if buf.filled().len() > before
            && c.busy.load(Relaxed) == 0
            && c.head_since.load(Relaxed) == 0
        {
            c.head_since.store(self.reg.now_ms() + 1, Relaxed);
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// How long `conn` may still stay open, or `None` when it is due to close: no limit
/// while a request is in flight, else the header-read deadline once a request head
/// has started, else the idle deadline.
fn time_left(conn: &Conn, reg: &Registry, limits: &ConnLimits) -> Option<Duration> {
    if conn.busy.load(Relaxed) > 0 {
        return Some(limits.idle_timeout.min(limits.header_read_timeout));
    }
    let (from, limit) = match conn.head_since.load(Relaxed) {
        0 => (conn.last.load(Relaxed), limits.idle_timeout),
        t => (t - 1, limits.header_read_timeout),
    };
    let elapsed = Duration::from_millis(reg.now_ms().saturating_sub(from));
    let left = limit.checked_sub(elapsed).filter(|d| !d.is_zero())?;
    // Re-check at least this often: a first byte may move the deadline earlier.
    Some(left.min(limits.idle_timeout.min(limits.header_read_timeout)))
}

/// Raises the soft open-file limit to the hard one (#18 item 1) and returns it.
pub fn raise_fd_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    Some(lim.rlim_cur)
}

/// Serves until `shutdown` resolves, then stops the worker (queued jobs get 503, the
/// running one stops) and waits for open connections to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    startup: Arc<Startup>,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let reg = Arc::new(Registry {
        t0: Instant::now(),
        next_id: AtomicU64::new(0),
        conns: Mutex::new(BTreeMap::new()),
    });
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    // Header and idle deadlines are kept by `time_left` (hyper's header timer would
    // also run on idle keep-alive connections).
    http.header_read_timeout(None).keep_alive(true);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut refused = 0u64;
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of fds (or a transient error): make room and retry shortly
                    // rather than spinning.
                    log!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Some((id, conn)) = reg.admit(limits.max_connections) else {
            refused += 1;
            if refused.is_power_of_two() {
                log!(
                    "connection limit {} reached with every connection busy: {refused} refused",
                    limits.max_connections
                );
            }
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (st, rg, cn) = (startup.clone(), reg.clone(), conn.clone());
        let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let guard = BusyGuard::new(cn.clone(), rg.clone());
            let st = st.clone();
            async move {
                let resp = st.handle(req.map(Body::new)).await;
                Ok::<_, std::convert::Infallible>(resp.map(|inner| GuardedBody {
                    inner,
                    _guard: guard,
                }))
            }
        });
        let io = Tracked {
            io: stream,
            conn: conn.clone(),
            reg: reg.clone(),
        };
        let watched = graceful.watch(http.serve_connection(TokioIo::new(io), svc));
        let (reg2, limits) = (reg.clone(), limits.clone());
        tokio::spawn(async move {
            let mut watched = std::pin::pin!(watched);
            while let Some(wait) = time_left(&conn, &reg2, &limits) {
                tokio::select! {
                    _ = &mut watched => break,
                    // Chosen as idle at the cap; a request that started since then
                    // is finished first (the idle timeout closes it later).
                    _ = conn.close.notified() => if conn.busy.load(Relaxed) == 0 { break },
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            reg2.remove(id);
        });
    }
    drop(listener);
    if let Some(s) = startup.shared() {
        s.begin_shutdown();
    }
    log!("closing {} connection(s)", reg.len());
    graceful.shutdown().await;
    Ok(())
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
        let limits = cfg.conn.clone();
        let shared = Shared::new(cfg, tok);
        let worker = spawn_worker(shared.clone(), engine);
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let addr = std_listener.local_addr().expect("local addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let startup = Startup::ready_with(shared.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
                let _ = serve(listener, startup, limits, async move {
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

#[cfg(test)]
mod tests {
    // #18 item 1: the soft open-file limit is raised to the hard one, so idle sockets
    // meet the connection cap long before the fd limit.
    #[test]
    fn fd_limit_is_raised_to_the_hard_limit() {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit only read and write the struct passed.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
            // Start below the hard limit (other tests of this process keep plenty).
            let low = libc::rlimit {
                rlim_cur: lim.rlim_max - lim.rlim_max / 8,
                rlim_max: lim.rlim_max,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &low), 0);
        }
        let got = super::raise_fd_limit().expect("getrlimit");
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!(lim.rlim_cur, lim.rlim_max);
        assert_eq!(got, lim.rlim_cur);
    }
}
