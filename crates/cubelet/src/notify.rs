//! systemd notifications (`sd_notify`): `READY=1` once reconciled, and a
//! periodic `WATCHDOG=1` while the agent is healthy when the unit sets
//! `WatchdogSec=` (systemd passes `WATCHDOG_USEC`, and `WATCHDOG_PID`).
//! Without `NOTIFY_SOCKET` nothing is sent.

use std::ffi::{OsStr, OsString};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use tracing::{debug, warn};

/// Sends `message` to the socket named by `NOTIFY_SOCKET`, if set. Failures
/// are logged, never fatal.
pub(crate) fn notify_systemd(message: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path, message) {
        warn!(error = %e, message, "sd_notify");
    }
}

/// Sends one datagram to a notify socket: a path, or `@name` for an abstract
/// socket.
pub(crate) fn send(socket: &OsStr, message: &str) -> std::io::Result<()> {
    let sender = std::os::unix::net::UnixDatagram::unbound()?;
    let bytes = socket.as_encoded_bytes();
    if let Some(abstract_name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)?;
        sender.send_to_addr(message.as_bytes(), &addr)?;
    } else {
        sender.send_to(message.as_bytes(), std::path::Path::new(socket))?;
    }
    Ok(())
}

/// The keep-alive period systemd asks for: half of `WATCHDOG_USEC`, or `None`
/// when the watchdog is off, the value is not a positive number, or
/// `WATCHDOG_PID` names another process.
pub(crate) fn watchdog_period(
    usec: Option<&str>,
    pid: Option<&str>,
    own_pid: u32,
) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|u| *u > 0)?;
    if let Some(pid) = pid {
        if pid.trim().parse::<u32>().ok() != Some(own_pid) {
            return None;
        }
    }
    Some(Duration::from_micros(usec / 2).max(Duration::from_millis(1)))
}

/// Sends `WATCHDOG=1` to `socket` every `period` while `healthy()` holds,
/// until `shutdown`. The first keep-alive goes out at once.
pub(crate) async fn watchdog(
    socket: OsString,
    period: Duration,
    healthy: impl Fn() -> bool + Send + 'static,
    shutdown: CancellationToken,
) {
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        if !healthy() {
            debug!("not healthy; watchdog keep-alive withheld");
            continue;
        }
        if let Err(e) = send(&socket, "WATCHDOG=1") {
            warn!(error = %e, "sd_notify WATCHDOG=1");
        }
    }
}

/// Starts the watchdog task when systemd asked for one (`NOTIFY_SOCKET` and
/// `WATCHDOG_USEC` set for this process); healthy means `/readyz` is ready.
pub(crate) fn spawn_watchdog(
    readiness: cubelet_metrics::Readiness,
    shutdown: CancellationToken,
) -> Option<tokio::task::JoinHandle<()>> {
    let socket = std::env::var_os("NOTIFY_SOCKET")?;
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    let period = watchdog_period(usec.as_deref(), pid.as_deref(), std::process::id())?;
    tracing::info!(?period, "systemd watchdog keep-alive enabled");
    Some(tokio::spawn(
        watchdog(socket, period, move || readiness.is_ready(), shutdown).in_current_span(),
    ))
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixDatagram;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::sync::Arc;

    use super::*;

    fn recv(sock: &UnixDatagram) -> String {
        let mut buf = [0u8; 64];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn period_is_half_of_watchdog_usec_for_this_process() {
        let me = 4242;
        assert_eq!(
            watchdog_period(Some("30000000"), None, me),
            Some(Duration::from_secs(15))
        );
        assert_eq!(
            watchdog_period(Some("2000000"), Some("4242"), me),
            Some(Duration::from_secs(1))
        );
        assert_eq!(watchdog_period(Some("2000000"), Some("1"), me), None);
        assert_eq!(watchdog_period(None, None, me), None);
        assert_eq!(watchdog_period(Some("0"), None, me), None);
        assert_eq!(watchdog_period(Some("soon"), None, me), None);
    }

    #[test]
    fn send_reaches_path_and_abstract_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let systemd = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "READY=1").unwrap();
        assert_eq!(recv(&systemd), "READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("cubelet-test-notify-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let abstract_systemd = UnixDatagram::bind_addr(&addr).unwrap();
        send(OsStr::new(&format!("@{name}")), "WATCHDOG=1").unwrap();
        assert_eq!(recv(&abstract_systemd), "WATCHDOG=1");
    }

    #[tokio::test]
    async fn watchdog_keeps_alive_while_healthy_and_stops_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let systemd = UnixDatagram::bind(&path).unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(watchdog(
            path.clone().into_os_string(),
            Duration::from_millis(5),
            || true,
            shutdown.clone(),
        ));
        let systemd = tokio::task::spawn_blocking(move || {
            for _ in 0..3 {
                assert_eq!(recv(&systemd), "WATCHDOG=1");
            }
            systemd
        })
        .await
        .unwrap();
        drop(systemd);
        shutdown.cancel();
        // The task ends on shutdown (it would hang this test otherwise).
        task.await.unwrap();
    }

    #[tokio::test]
    async fn watchdog_is_withheld_while_unhealthy() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let systemd = UnixDatagram::bind(&path).unwrap();
        systemd.set_nonblocking(true).unwrap();
        let checks = Arc::new(AtomicU32::new(0));
        let healthy = Arc::new(AtomicBool::new(false));
        let shutdown = CancellationToken::new();
        let task = {
            let checks = Arc::clone(&checks);
            let healthy = Arc::clone(&healthy);
            tokio::spawn(watchdog(
                path.clone().into_os_string(),
                Duration::from_millis(2),
                move || {
                    checks.fetch_add(1, Ordering::SeqCst);
                    healthy.load(Ordering::SeqCst)
                },
                shutdown.clone(),
            ))
        };
        // Several health checks have run (and answered "unhealthy"); each
        // would have sent synchronously right after its check.
        while checks.load(Ordering::SeqCst) < 4 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut buf = [0u8; 64];
        let err = systemd.recv(&mut buf).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock);

        healthy.store(true, Ordering::SeqCst);
        systemd.set_nonblocking(false).unwrap();
        let systemd = tokio::task::spawn_blocking(move || recv(&systemd))
            .await
            .unwrap();
        assert_eq!(systemd, "WATCHDOG=1");
        shutdown.cancel();
        task.await.unwrap();
    }
}
