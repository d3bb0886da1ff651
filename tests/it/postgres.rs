//! The appliance on PostgreSQL (`bca init --store postgres://…`): a real PostgreSQL 15 cluster,
//! started by the tests themselves on a Unix socket (`bca::store::pg_cluster`), read back with
//! `psql`, the third-party client.

use crate::common::*;
use bca::proto::protocol::Reply;
use bca::store::pg_cluster::Cluster;
use serde_json::json;
use std::process::Command;

/// `psql`'s answer to `sql` on the database of `url` (unaligned, tuples only).
fn psql(c: &Cluster, url: &str, sql: &str) -> String {
    let db = url.rsplit('/').next().unwrap();
    let o = Command::new("psql")
        .arg("-h")
        .arg(&c.dir)
        .args([
            "-p",
            &c.port.to_string(),
            "-U",
            c.user,
            "-d",
            db,
            "-Atc",
            sql,
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

/// An appliance whose site lives in a new database of `c`.
fn on_postgres(c: &Cluster) -> (Appliance, String) {
    let url = c.new_database();
    let a = Appliance::start_with("file", &["--store", &url]);
    (a, url)
}

#[test]
fn an_appliance_on_postgres_admits_exactly_what_a_token_allows() {
    let c = Cluster::shared();
    let (a, url) = on_postgres(c);
    // The state directory holds no database; config.toml names the store, no password.
    assert!(!a.state().join("bca.db").exists());
    let cfg = std::fs::read_to_string(a.state().join("config.toml")).unwrap();
    assert!(cfg.contains("[store]") && cfg.contains(&url), "{cfg}");
    assert_eq!(psql(c, &url, "SELECT count(*) FROM site"), "1");

    // 20 machines race for a token with 5 uses: 5 admitted, 15 refused, none over.
    let pool = a.pool("p1");
    let (t, token) = a.token(&pool, json!({"maxUses": 5}));
    let sim = Sim::new(&a);
    let answers: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..20)
            .map(|_| s.spawn(|| sim.join(&token, &machine()).0))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let admitted = answers
        .iter()
        .filter(|r| {
            serde_json::from_slice::<Reply>(r)
                .unwrap()
                .join_response
                .is_some()
        })
        .count();
    let refused = answers.iter().filter(|r| **r == refused_bytes()).count();
    assert_eq!((admitted, refused), (5, 15));
    let id = t["id"].as_str().unwrap();
    assert_eq!(
        psql(
            c,
            &url,
            &format!("SELECT uses_left FROM join_tokens WHERE id = '{id}'")
        ),
        "0"
    );
    assert_eq!(psql(c, &url, "SELECT count(*) FROM nodes"), "5");
    assert_eq!(psql(c, &url, "SELECT count(*) FROM node_certs"), "5");
    assert_eq!(
        psql(
            c,
            &url,
            "SELECT count(*) FROM events WHERE type = 'node.joined'"
        ),
        "5"
    );
    // The token's secret is stored as its hash only.
    assert!(!psql(
        c,
        &url,
        "SELECT encode(secret_sha256, 'hex') FROM join_tokens"
    )
    .contains(&token));

    // /healthz names the engine, and that it takes writes, and the schema.
    let (code, body) = curl(&a, "/healthz", "GET");
    assert_eq!(code, 200, "{body}");
    let h: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(h["store"]["engine"], "postgres", "{h}");
    assert_eq!(h["store"]["writable"], true, "{h}");
    assert_eq!(
        h["store"]["schemaVersion"],
        bca::store::PG_MIGRATIONS.len() as i64,
        "{h}"
    );

    // The CLI reads the same site: the nodes, as the API lists them.
    let o = a.cli(&["nodes", "list", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let listed = String::from_utf8_lossy(&o.stdout)
        .matches("\"node_")
        .count();
    assert!(listed >= 5, "{}", String::from_utf8_lossy(&o.stdout));
}

#[test]
fn a_bad_store_is_refused_before_anything_is_made() {
    let c = Cluster::shared();
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("pw");
    std::fs::write(&pw, "secret-pw\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o644)).unwrap();
    let url = c.new_database();
    let with_password = url.replacen("bca@", "bca:secret-pw@", 1);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--store".into(), with_password], "carries a password"),
        (
            vec!["--store".into(), "mysql://x".into()],
            "not a PostgreSQL URL",
        ),
        (
            vec![
                "--store".into(),
                url.clone(),
                "--store-password-file".into(),
                pw.display().to_string(),
            ],
            "readable by others",
        ),
        (
            vec!["--store-password-file".into(), pw.display().to_string()],
            "goes with --store",
        ),
        (
            vec![
                "--store".into(),
                "postgres://bca@db.example.net/site".into(),
            ],
            "through its Unix socket",
        ),
        (
            vec![
                "--store".into(),
                "postgres://bca@127.0.0.1:5432/site".into(),
            ],
            "through its Unix socket",
        ),
        (
            vec!["--store".into(), format!("{url}?hostaddr=192.0.2.2")],
            "through its Unix socket",
        ),
        (
            vec![
                "--store".into(),
                "postgres://bca:secret-pw@localhost:99999/site".into(),
            ],
            "not a PostgreSQL URL",
        ),
        (
            vec!["--store".into(), c.url("no_such_database")],
            "cannot reach the store's database",
        ),
    ];
    for (args, says) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (d, out) = init_dir("file", &args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{args:?} was taken");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("secret-pw"), "{err}");
        assert!(
            !d.path().join("state/config.toml").exists(),
            "{args:?} left a config"
        );
    }
    // Nothing was written to the database either.
    assert_eq!(
        psql(
            c,
            &url,
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'site'"
        ),
        "0"
    );

    // A database that already holds a site is not initialised again.
    let (_a, url) = on_postgres(c);
    let (d, out) = init_dir("file", &["--store", &url]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already holds a site"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!d.path().join("state/config.toml").exists());
    assert_eq!(psql(c, &url, "SELECT count(*) FROM site"), "1");
}

/// The database stops while the appliance serves: a join answers `UNAVAILABLE` within the
/// deadline (never hangs, writes nothing), and once the database is back the appliance serves
/// again by itself.
#[test]
fn the_database_gone_answers_unavailable_and_recovers_by_itself() {
    let c = Cluster::start().unwrap();
    let url = c.new_database();
    let a = Appliance::start_with("file", &["--store", &url]);
    let pool = a.pool("p1");
    let root = a.root_tenant();
    let (_, token) = a.token(&pool, json!({"maxUses": 100}));
    let sim = Sim::new(&a);
    assert!(
        serde_json::from_slice::<Reply>(&sim.join(&token, &machine()).0)
            .unwrap()
            .join_response
            .is_some()
    );
    c.stop().unwrap();
    let t = std::time::Instant::now();
    let (raw, _, _) = sim.join(&token, &machine());
    assert!(t.elapsed() < std::time::Duration::from_secs(30));
    let r: Reply = serde_json::from_slice(&raw).unwrap();
    assert!(r.join_response.is_none(), "admitted with no database");
    let (code, body) = curl(&a, "/healthz", "GET");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"failing\""), "{body}");
    let e = a
        .api("pools/list", json!({"tenantId": root}))
        .expect_err("answered with no database");
    assert_eq!(e.code.as_str(), "UNAVAILABLE", "{e:?}");
    assert!(e.message.contains("database"), "{e:?}");

    // Back: the appliance reconnects by itself.
    c.restart().unwrap();
    wait_for("the appliance to serve again", 30, || {
        serde_json::from_slice::<Reply>(&sim.join(&token, &machine()).0)
            .ok()?
            .join_response
            .map(|_| ())
    });
    assert_eq!(psql(&c, &url, "SELECT count(*) FROM nodes"), "2");
}

/// `bca store migrate --to`: a populated SQLite appliance (tokens, nodes, certificates, a join
/// request, events, audit) moves into an empty PostgreSQL database, every table row for row;
/// its agents renew against it with nothing changed on their side. Refused while serving, and
/// into a database that holds a site.
#[test]
fn a_sqlite_appliance_moves_to_postgres_and_its_agents_keep_renewing() {
    let c = Cluster::shared();
    let mut a = crate::discovery::appliance("always");
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 5}));
    let sim = Sim::new(&a);
    let mut held = Vec::new();
    for _ in 0..3 {
        let (raw, csr, key) = sim.join(&token, &machine());
        let resp = serde_json::from_slice::<Reply>(&raw)
            .unwrap()
            .join_response
            .unwrap();
        let body = bca::agent::verify_response(&sim.cfg, &resp, &csr, &key, "node").unwrap();
        held.push(crate::faults::held(
            body.node_id,
            &body.certificate_chain,
            key,
        ));
    }
    // A machine waiting for an approval.
    let waiting = crate::crash::waiting_machine(&a, "52:54:00:ee:00:01");
    let before: Vec<(String, i64)> = bca::store::maintenance::tables()
        .unwrap()
        .into_iter()
        .map(|(t, _)| {
            let n = a.count(&format!("SELECT count(*) FROM {t}"));
            (t, n)
        })
        .collect();
    assert!(
        before.iter().filter(|(_, n)| *n > 0).count() >= 8,
        "{before:?}"
    );

    // Refused while bca serve runs: nothing copied.
    let url = c.new_database();
    let o = a.cli(&["store", "migrate", "--to", &url]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("stop it first"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        psql(
            c,
            &url,
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'site'"
        ),
        "0"
    );

    a.stop();
    // Refused into a database that holds a site.
    let (_other, taken) = on_postgres(c);
    let o = a.cli(&["store", "migrate", "--to", &taken]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("already holds a site"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(a.state().join("bca.db").exists());

    let o = a.cli(&["store", "migrate", "--to", &url]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!a.state().join("bca.db").exists());
    assert!(std::fs::read_dir(a.state()).unwrap().flatten().any(|e| e
        .file_name()
        .to_string_lossy()
        .starts_with("bca.db.migrated-")));
    for (t, n) in &before {
        assert_eq!(
            psql(c, &url, &format!("SELECT count(*) FROM {t}")),
            n.to_string(),
            "{t}"
        );
    }

    // The appliance serves from PostgreSQL; its agents renew, the waiting machine is approved
    // and joins, the token's last uses are spent there.
    let (http, gw) = (a.http.clone(), a.gateway.clone());
    a.serve_at(PASSPHRASE, &http, &gw);
    for h in &held {
        assert!(
            crate::faults::renew(&sim.cfg, h).is_some(),
            "{} could not renew after the move",
            h.id
        );
    }
    let root = a.root_tenant();
    let intake = a.pool("intake");
    a.api_ok(
        "joinRequests/approve",
        json!({"tenantId": root, "poolId": intake, "requestId": waiting.request}),
    );
    assert!(crate::crash::admitted_join(&sim, &waiting).is_some());
    sim.admitted(&token, &machine());
    assert_eq!(psql(c, &url, "SELECT count(*) FROM nodes"), "5");
    assert_eq!(
        psql(c, &url, "SELECT count(*) FROM node_certs"),
        (before.iter().find(|(t, _)| t == "node_certs").unwrap().1 + 5).to_string()
    );
}

/// One appliance per database until several are supported: a copy of a PostgreSQL appliance's
/// state directory (a restored backup, say) cannot serve the same database beside it, so no
/// token is spent by two writers at once; and one `bca serve` per state directory.
#[test]
fn a_copy_of_an_appliance_serving_on_one_database_is_refused() {
    let c = Cluster::shared();
    let (a, url) = on_postgres(c);
    let copy = a.dir.path().join("copy");
    let o = Command::new("cp")
        .arg("-a")
        .arg(a.state())
        .arg(&copy)
        .output()
        .unwrap();
    assert!(o.status.success());
    let _ = std::fs::remove_file(copy.join("admin.sock"));
    let o = serve_exit(&copy, PASSPHRASE);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("another bca serve runs as appliance"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The first still serves, and nothing was written by the second.
    let pool = a.pool("p1");
    assert!(!pool.is_empty());
    assert_eq!(psql(c, &url, "SELECT count(*) FROM pools"), "1");

    // A second serve on the same state directory: refused by its lock, whatever its sockets.
    let other = a.dir.path().join("other.sock");
    let o = serve_exit_with(
        &a.state(),
        PASSPHRASE,
        &["--admin-socket", other.to_str().unwrap()],
    );
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("holds the state directory's lock"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
