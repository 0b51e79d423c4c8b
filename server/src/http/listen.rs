//! Connections: accepted on the listener, served by hyper's HTTP/1 with a
//! header read timeout (a client that opens a connection and never
//! finishes its headers — slowloris — is dropped, and so is one idle
//! between requests for as long), each watched so that a stopping server
//! can let the replies in flight end.

use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// The connections of one server.
pub struct Connections {
    router: Router,
    http: http1::Builder,
    graceful: GracefulShutdown,
}

impl Connections {
    /// Serves `router`; headers must arrive within `header_timeout`.
    pub fn new(router: Router, header_timeout: Duration) -> Self {
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .keep_alive(true);
        Connections {
            router,
            http,
            graceful: GracefulShutdown::new(),
        }
    }

    /// Takes the next connection off `listener` and serves it on a task of
    /// its own. When the process is out of file descriptors (or another
    /// accept error), waits a moment instead of spinning.
    pub async fn accept(&self, listener: &TcpListener) {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                let svc = TowerToHyperService::new(self.router.clone());
                let conn = self.http.serve_connection(TokioIo::new(stream), svc);
                let watched = self.graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = watched.await;
                });
            }
            Err(e) => {
                tracing::warn!("accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Asks every connection to close once its reply in flight is sent,
    /// and waits at most `bound` for them.
    pub async fn close(self, bound: Duration) {
        let _ = tokio::time::timeout(bound, self.graceful.shutdown()).await;
    }
}
