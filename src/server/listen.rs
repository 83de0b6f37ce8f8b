//! The HTTP accept loop: the router served by hyper's HTTP/1 connection, with
//! a per-connection idle timeout (`axum::serve` sets none: a client could hold
//! a connection open forever without sending a request) and a graceful
//! shutdown that lets open responses finish.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// Serves `app` on `listener` until `shutdown` completes, then waits for the
/// open connections to finish their responses. A connection that has not
/// sent a complete request head within `idle` — a new one, or a kept-alive
/// one between requests — is closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()>,
    idle: Duration,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    // hyper's header read timeout runs whenever the connection waits for a
    // request head, so it is also the keep-alive idle timeout.
    http.timer(TokioTimer::new()).header_read_timeout(idle);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors and the like: back off, go on.
                    eprintln!("kiln-server: accept failed: {error}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A client that resets or times out is no error of the server's.
            let _ = connection.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
