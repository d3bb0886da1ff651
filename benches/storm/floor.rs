//! The floor under a join and a renewal on the appliance's core that no appliance code can go
//! below: the kernel's and an async runtime's cost of the bytes a join or a renewal moves, with
//! no TLS, no JSON, no SQLite and no second process. A tiny tokio server (this bench again,
//! pinned to core 0, in `BCA_BENCH_FLOOR` mode) answers fixed-size flights; the load generator
//! (core 1) plays the agents. Its CPU time per connection (a join) or per round trip on an open
//! connection (a renewal), added to the crypto ceiling's time, bounds what one core could do:
//! a target above that bound cannot be met on this core whatever the appliance's own code costs.
//!
//! The flights carry a join's and a renewal's bytes as this bench's storms send them: on
//! 2026-12-06, 7,149 bytes in 16 packets per join and 5,047 bytes in 3 packets per renewal on
//! loopback, of which 66 bytes a packet are headers. The storms and the floors print their
//! loopback bytes and packets beside each other, to compare in the same run.

use super::{cpu_seconds_of, line, machine_addr, taskset};
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A join on a new connection, TLS 1.3's two round trips: the client's hello, the server's
/// flight (hello, certificate chain, finished), the client's finished and join request, the
/// server's answer (the signed response and certificate chain); then the server closes.
const JOIN_FLIGHTS: [usize; 4] = [300, 1_700, 2_000, 2_100];
/// A renewal on an established session: the request (CSR, chain, proof) and the answer.
const RENEW_FLIGHTS: [usize; 2] = [2_250, 2_600];
/// Round trips each open connection makes in the renewal floor.
const RENEW_ROUNDS: usize = 50;

/// The server side, run pinned to core 0: prints its port, then answers until killed. The
/// first byte of a connection says which floor it plays: `j` or `r`.
pub fn serve() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", l.local_addr().unwrap().port());
        loop {
            let (s, _) = l.accept().await.unwrap();
            tokio::spawn(async move {
                let _ = answer(s).await;
            });
        }
    });
}

async fn answer(mut s: tokio::net::TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut buf = vec![0u8; 4096];
    let mode = s.read_u8().await?;
    if mode == b'j' {
        for (i, n) in JOIN_FLIGHTS.iter().enumerate() {
            if i % 2 == 0 {
                s.read_exact(&mut buf[..*n]).await?;
            } else {
                s.write_all(&buf[..*n]).await?;
            }
        }
        return Ok(());
    }
    loop {
        match s.read_exact(&mut buf[..RENEW_FLIGHTS[0]]).await {
            Ok(_) => s.write_all(&buf[..RENEW_FLIGHTS[1]]).await?,
            Err(_) => return Ok(()),
        }
    }
}

/// Loopback's transmitted bytes and packets so far.
pub fn loopback() -> (u64, u64) {
    let read = |f: &str| {
        std::fs::read_to_string(format!("/sys/class/net/lo/statistics/{f}"))
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (read("tx_bytes"), read("tx_packets"))
}

/// Prints `name_loopback_bytes` and `name_loopback_packets` per unit since `since`.
pub fn loopback_lines(name: &str, since: (u64, u64), units: usize, unit: &str) {
    let now = loopback();
    let per = |a: u64, b: u64| (a - b) as f64 / units.max(1) as f64;
    line(
        &format!("{name}_loopback_bytes"),
        per(now.0, since.0),
        &format!("bytes/{unit}"),
    );
    line(
        &format!("{name}_loopback_packets"),
        per(now.1, since.1),
        &format!("packets/{unit}"),
    );
}

/// Measures both floors against the crypto ceilings measured on the same core (`join_ceiling`
/// joins/s, `renewal_ceiling` renewals/s) and prints the bounds.
pub fn measure(joins: usize, conc: usize, join_ceiling: f64, renewal_ceiling: f64) {
    let mut server = taskset("0")
        .arg(std::env::current_exe().unwrap())
        .arg("--bench")
        .env("BCA_BENCH_PINNED", "1")
        .env("BCA_BENCH_FLOOR", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut port = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    let dst: std::net::SocketAddr = format!("127.0.0.1:{}", port.trim()).parse().unwrap();
    let pid = server.id();
    let rt = super::load_runtime();

    // Joins: one connection each, `conc` at once, every flight read in full.
    let (cpu0, lo0) = (cpu_seconds_of(pid), loopback());
    let t = Instant::now();
    rt.block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(conc));
        let mut hs = Vec::new();
        for i in 0..joins {
            let sem = sem.clone();
            hs.push(tokio::spawn(async move {
                let _p = sem.acquire_owned().await.unwrap();
                let mut s = connect(machine_addr(i), dst).await;
                s.write_u8(b'j').await.unwrap();
                let mut buf = vec![0u8; 4096];
                for (k, n) in JOIN_FLIGHTS.iter().enumerate() {
                    if k % 2 == 0 {
                        s.write_all(&buf[..*n]).await.unwrap();
                    } else {
                        s.read_exact(&mut buf[..*n]).await.unwrap();
                    }
                }
                // The server closes once it answered.
                assert_eq!(s.read(&mut buf).await.unwrap(), 0);
            }));
        }
        for h in hs {
            h.await.unwrap();
        }
    });
    let wall = t.elapsed().as_secs_f64();
    let join_us = (cpu_seconds_of(pid) - cpu0) / joins as f64 * 1e6;
    line("join_floor_tcp_us", join_us, "us");
    line("join_floor_tcp_rate", joins as f64 / wall, "connections/s");
    loopback_lines("join_floor", lo0, joins, "connection");
    let join_bound = 1.0 / (1.0 / join_ceiling + join_us / 1e6);
    line("join_bound_crypto_and_tcp", join_bound, "joins/s/core");
    line(
        "join_bound_fraction_of_ceiling",
        join_bound / join_ceiling,
        "",
    );

    // Renewals: `conc` connections opened first (not measured), then round trips on each.
    let conns: Vec<_> = rt.block_on(async {
        let mut v = Vec::new();
        for i in 0..conc {
            let mut s = connect(machine_addr(i), dst).await;
            s.write_u8(b'r').await.unwrap();
            v.push(s);
        }
        v
    });
    let rounds = conc * RENEW_ROUNDS;
    let (cpu0, lo0) = (cpu_seconds_of(pid), loopback());
    rt.block_on(async {
        let mut hs = Vec::new();
        for mut s in conns {
            hs.push(tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                for _ in 0..RENEW_ROUNDS {
                    s.write_all(&buf[..RENEW_FLIGHTS[0]]).await.unwrap();
                    s.read_exact(&mut buf[..RENEW_FLIGHTS[1]]).await.unwrap();
                }
            }));
        }
        for h in hs {
            h.await.unwrap();
        }
    });
    let renew_us = (cpu_seconds_of(pid) - cpu0) / rounds as f64 * 1e6;
    line("renewal_floor_tcp_us", renew_us, "us");
    loopback_lines("renewal_floor", lo0, rounds, "round trip");
    let renew_bound = 1.0 / (1.0 / renewal_ceiling + renew_us / 1e6);
    line(
        "renewal_bound_crypto_and_tcp",
        renew_bound,
        "renewals/s/core",
    );
    line(
        "renewal_bound_fraction_of_ceiling",
        renew_bound / renewal_ceiling,
        "",
    );
    let _ = server.kill();
    let _ = server.wait();
}

async fn connect(src: std::net::IpAddr, dst: std::net::SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::new(src, 0)).unwrap();
    let s = socket.connect(dst).await.unwrap();
    s.set_nodelay(true).unwrap();
    s
}
