//! The floor under a join and a renewal on the appliance's core that no appliance code can go
//! below: the kernel's and an async runtime's cost of the bytes a join or a renewal moves, with
//! no TLS, no JSON, no SQLite and no second process. A tiny tokio server (this bench again,
//! pinned to core 0, in `BCA_BENCH_FLOOR` mode) answers fixed-size flights; the load generator
//! (core 1) plays the agents. Its CPU time per connection (a join) or per round trip on an open
//! connection (a renewal), added to the crypto ceiling's time, bounds what one core could do in
//! that minute: a target above that bound cannot be met on it whatever the appliance's own code
//! costs. (The one load core does not saturate the floor server: 0.62-0.78 busy for joins on
//! 2026-12-06, `join_floor_server_core_busy`; a saturated one might spend a little less per
//! event, batching more in each `epoll_wait`.)
//!
//! The flights carry a join's and a renewal's payload as this bench's storms send them: on
//! 2026-12-06, 7,150 bytes in 16.7 packets per join and 5,651 bytes in 4 packets per renewal on
//! loopback, whose byte counts include 52 bytes of IP and TCP headers a packet (60 on a SYN). The
//! split between the two directions is estimated. The storms and the floors print their loopback
//! bytes and packets beside each other, to compare in the same run.

use super::{line, machine_addr, taskset, tcp_from};
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A join on a new connection, TLS 1.3's two round trips: the client's hello, the server's
/// flight (hello, certificate chain, finished), the client's finished and join request, the
/// server's answer (the signed response and certificate chain); then the server closes.
/// The first flight's first byte says which floor a connection plays: `j` or `r`.
const JOIN_FLIGHTS: [usize; 4] = [300, 1_700, 2_000, 2_280];
/// A renewal on an established session: the request (CSR, chain, proof) and the answer. The
/// connection opens with a flight of `JOIN_FLIGHTS[0]` bytes starting with `r`, acknowledged
/// with one byte, outside the measurement.
const RENEW_FLIGHTS: [usize; 2] = [2_300, 3_150];
/// Round trips each open connection makes in the renewal floor.
const RENEW_ROUNDS: usize = 50;

/// The server side, run pinned to core 0: prints its port, then answers until its standard
/// input closes (the bench ends, however it ends).
pub fn serve() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", l.local_addr().unwrap().port());
        // A thread waits for standard input to close, then ends the process.
        std::thread::spawn(|| {
            let _ = std::io::Read::read(&mut std::io::stdin(), &mut [0u8; 1]);
            std::process::exit(0);
        });
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
    s.read_exact(&mut buf[..JOIN_FLIGHTS[0]]).await?;
    if buf[0] == b'j' {
        return join_flights(&mut s, &mut buf, 1, false).await;
    }
    s.write_u8(b'r').await?;
    loop {
        match s.read_exact(&mut buf[..RENEW_FLIGHTS[0]]).await {
            Ok(_) => s.write_all(&buf[..RENEW_FLIGHTS[1]]).await?,
            Err(_) => return Ok(()),
        }
    }
}

/// A join's flights from `from` on: the client writes the even ones and reads the odd ones, the
/// server the other way round.
async fn join_flights(
    s: &mut tokio::net::TcpStream,
    buf: &mut [u8],
    from: usize,
    client: bool,
) -> std::io::Result<()> {
    for (i, n) in JOIN_FLIGHTS.iter().enumerate().skip(from) {
        if (i % 2 == 0) == client {
            s.write_all(&buf[..*n]).await?;
        } else {
            s.read_exact(&mut buf[..*n]).await?;
        }
    }
    Ok(())
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

/// CPU time of a process's live threads so far, in seconds, to the nanosecond (the scheduler's
/// own count, `/proc/<pid>/task/*/schedstat`). Not `cpu_seconds_of`: `/proc/<pid>/stat` counts in
/// 10 ms ticks, a tick per 10,000 of the renewal floor's round trips; it also counts threads that
/// have exited, which the appliance's figures need and the floor server, whose threads live to
/// its end, does not.
fn run_seconds(pid: u32) -> f64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum::<u64>() as f64
        / 1e9
}

/// A floor's lines: the server's CPU time per unit (`name_floor_tcp_us`), its share of the core
/// while `wall` ran, and the bound it and the crypto ceiling set: 1 / (1 / `ceiling` + floor).
fn bound_lines(name: &str, cpu: f64, wall: f64, units: usize, ceiling: f64, unit: &str) {
    let floor = cpu / units as f64;
    line(&format!("{name}_floor_tcp_us"), floor * 1e6, "us");
    line(&format!("{name}_floor_server_core_busy"), cpu / wall, "");
    let bound = 1.0 / (1.0 / ceiling + floor);
    line(&format!("{name}_bound_crypto_and_tcp"), bound, unit);
    line(
        &format!("{name}_bound_fraction_of_ceiling"),
        bound / ceiling,
        "",
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
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The server stops when this closes: at the end below, or when this bench ends otherwise.
    let stdin = server.stdin.take();
    let mut port = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    let dst: std::net::SocketAddr = format!("127.0.0.1:{}", port.trim()).parse().unwrap();
    let pid = server.id();
    let rt = super::load_runtime();

    // Joins: one connection each, `conc` at once, every flight read in full.
    let (cpu0, lo0) = (run_seconds(pid), loopback());
    let t = Instant::now();
    rt.block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(conc));
        let mut hs = Vec::new();
        for i in 0..joins {
            let sem = sem.clone();
            hs.push(tokio::spawn(async move {
                let _p = sem.acquire_owned().await.unwrap();
                let mut s = tcp_from(machine_addr(i), dst).await.unwrap();
                let mut buf = vec![0u8; 4096];
                buf[0] = b'j';
                join_flights(&mut s, &mut buf, 0, true).await.unwrap();
                // The server closes once it answered.
                assert_eq!(s.read(&mut buf).await.unwrap(), 0);
            }));
        }
        for h in hs {
            h.await.unwrap();
        }
    });
    let wall = t.elapsed().as_secs_f64();
    let join_cpu = run_seconds(pid) - cpu0;
    line("join_floor_tcp_rate", joins as f64 / wall, "connections/s");
    loopback_lines("join_floor", lo0, joins, "connection");
    bound_lines("join", join_cpu, wall, joins, join_ceiling, "joins/s/core");

    // Renewals: `conc` connections opened and acknowledged first, then round trips on each;
    // the connections are closed after the measurement.
    let conns: Vec<_> = rt.block_on(async {
        let mut v = Vec::new();
        for i in 0..conc {
            let mut s = tcp_from(machine_addr(i), dst).await.unwrap();
            let mut first = [0u8; JOIN_FLIGHTS[0]];
            first[0] = b'r';
            s.write_all(&first).await.unwrap();
            assert_eq!(s.read_u8().await.unwrap(), b'r');
            v.push(s);
        }
        v
    });
    let rounds = conc * RENEW_ROUNDS;
    let (cpu0, lo0) = (run_seconds(pid), loopback());
    let t = Instant::now();
    let conns = rt.block_on(async {
        let mut hs = Vec::new();
        for mut s in conns {
            hs.push(tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                for _ in 0..RENEW_ROUNDS {
                    s.write_all(&buf[..RENEW_FLIGHTS[0]]).await.unwrap();
                    s.read_exact(&mut buf[..RENEW_FLIGHTS[1]]).await.unwrap();
                }
                s
            }));
        }
        let mut out = Vec::new();
        for h in hs {
            out.push(h.await.unwrap());
        }
        out
    });
    let renew_cpu = run_seconds(pid) - cpu0;
    let wall = t.elapsed().as_secs_f64();
    loopback_lines("renewal_floor", lo0, rounds, "round trip");
    drop(conns);
    bound_lines(
        "renewal",
        renew_cpu,
        wall,
        rounds,
        renewal_ceiling,
        "renewals/s/core",
    );
    drop(stdin);
    let _ = server.wait();
}
