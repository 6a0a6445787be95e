//! memfoldd's Prometheus endpoint: `GET /metrics` over HTTP (`tiny_http`), on a thread
//! of its own.
//!
//! How a scrape gets its snapshot: the HTTP thread asks memfoldd for its statistics over
//! memfoldd's own socket, as `memfold status` does ([`crate::query_stats`]). memfoldd's
//! main loop answers that request between two steps of its work, from the books as they
//! are then (`daemon::books::stats`), and goes on; the HTTP thread then builds the
//! exposition and writes it to the scraper. Nothing the engine loop waits on is held while
//! a scraper reads, and a slow or stuck scraper only holds this thread. The answer is
//! reused for a second ([`crate::reused`]): however often the address is asked, memfoldd
//! reads its books for it at most once a second.
//!
//! The answer is OpenMetrics text ([`memfold_wire::metrics::CONTENT_TYPE`]) to a client
//! that accepts it (Prometheus asks for it first), else the classic text format 0.0.4
//! ([`memfold_wire::metrics::prometheus_text`]), which `promtool check metrics` reads.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crate::reused::{Reused, REUSE_FOR};
use memfold_wire::metrics::{prometheus_text, CONTENT_TYPE, CONTENT_TYPE_TEXT};
use memfold_wire::Stats;
use tiny_http::{Header, Method, Request, Response, Server};

/// Errors starting the endpoint.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address is not a loopback one and remote scrapes were not allowed.
    #[error(
        "metrics endpoint {addr}: not a loopback address; the statistics name every guest, \
         so serving them beyond this host needs --metrics-allow-remote"
    )]
    NotLoopback {
        /// The address asked for.
        addr: SocketAddr,
    },
    /// The address could not be bound.
    #[error("metrics endpoint {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Cause.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The serving thread could not be started.
    #[error("metrics endpoint {addr}: no thread: {source}")]
    Thread {
        /// The address asked for.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
}

/// The running endpoint; it serves until [`MetricsServer::stop`] or the process ends.
pub struct MetricsServer {
    server: Arc<Server>,
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Serves `GET /metrics` at `listen` with the statistics of the memfoldd at `socket`.
    /// A non-loopback `listen` is refused unless `allow_remote`.
    ///
    /// Errors: [`MetricsError`] (not loopback, the address cannot be bound, no thread).
    pub fn start(
        listen: SocketAddr,
        allow_remote: bool,
        socket: PathBuf,
    ) -> Result<MetricsServer, MetricsError> {
        if !listen.ip().is_loopback() && !allow_remote {
            return Err(MetricsError::NotLoopback { addr: listen });
        }
        let server = Arc::new(Server::http(listen).map_err(|source| MetricsError::Bind {
            addr: listen,
            source,
        })?);
        let addr = server
            .server_addr()
            .to_ip()
            .expect("an HTTP server bound to an IP address");
        let s = server.clone();
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                // Whoever reaches the address may ask: one request to memfoldd a
                // second at most, whatever the rate of GETs (`crate::reused`).
                let mut reused = Reused::new(REUSE_FOR);
                for req in s.incoming_requests() {
                    answer(req, &socket, &mut reused);
                }
            })
            .map_err(|source| MetricsError::Thread {
                addr: listen,
                source,
            })?;
        tracing::info!("metrics at http://{addr}/metrics");
        Ok(MetricsServer {
            server,
            addr,
            thread: Some(thread),
        })
    }

    /// The address it listens on (the port the kernel chose for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and waits for the thread to end.
    pub fn stop(mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn header(value: &str) -> Header {
    Header::from_bytes(&b"Content-Type"[..], value.as_bytes()).expect("a valid header")
}

/// Answers one request.
fn answer(req: Request, socket: &std::path::Path, reused: &mut Reused<(), Result<Stats, String>>) {
    let text = |code: u16, body: String| {
        Response::from_string(body)
            .with_status_code(code)
            .with_header(header("text/plain; charset=utf-8"))
    };
    let path = req.url().split('?').next().unwrap_or("");
    let resp = match (req.method(), path) {
        (Method::Get, "/metrics") => match reused.get_or((), Instant::now(), || {
            crate::query_stats(socket).map_err(|e| e.to_string())
        }) {
            Ok(stats) => {
                let om = stats.exposition();
                let wants_om = req.headers().iter().any(|h| {
                    h.field.equiv("Accept")
                        && h.value.as_str().contains("application/openmetrics-text")
                });
                if wants_om {
                    Response::from_string(om).with_header(header(CONTENT_TYPE))
                } else {
                    Response::from_string(prometheus_text(&om))
                        .with_header(header(CONTENT_TYPE_TEXT))
                }
            }
            Err(e) => text(
                503,
                format!("no statistics from memfoldd at {}: {e}\n", socket.display()),
            ),
        },
        (Method::Get, _) => text(404, "memfoldd serves /metrics only\n".into()),
        _ => text(405, "GET /metrics only\n".into()),
    };
    let _ = req.respond(resp);
}
