//! How the network child ([`crate::daemon::privsep`]) confines itself before it reads from the network:
//! another user, Landlock, `no_new_privs` and a seccomp allow-list. Called once, on the child's
//! only thread, before the runtime starts its workers: every thread inherits all four.

use landlock::{
    Access, AccessFs, AccessNet, PathBeneath, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, Scope, ABI,
};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Confines the calling process; returns the uid it now runs as and what Landlock enforced.
/// `read_beneath`: directories (held open) whose files may be read; nothing else may.
/// `shared`: the sockets the parent handed over and will hand to the next child too: they may
/// be read and answered on, never reconfigured (see [`seccomp`]). `recvmsg_on`: the UDP sockets
/// (DHCP) read with `recvmsg`, for each datagram's destination address; `recvmsg` on anything
/// else stays refused.
pub fn confine(
    user: Option<(u32, u32)>,
    read_beneath: &[BorrowedFd<'_>],
    shared: &[BorrowedFd<'_>],
    recvmsg_on: &[BorrowedFd<'_>],
) -> Result<(u32, String), String> {
    if let Some((uid, gid)) = user {
        become_user(uid, gid)?;
    }
    drop_capabilities()?;
    // After the change of user, which clears it: the child dies with its parent.
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .map_err(|e| format!("confine: PR_SET_PDEATHSIG: {e}"))?;
    // Again after the change of user, which resets it to the system's default: no core dump
    // and no ptrace by its user (it holds the session-ticket keys).
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(|e| format!("confine: PR_SET_DUMPABLE: {e}"))?;
    let landlock = landlock(read_beneath)?;
    let shared: Vec<u64> = shared.iter().map(|f| f.as_raw_fd() as u64).collect();
    let recvmsg_on: Vec<u64> = recvmsg_on.iter().map(|f| f.as_raw_fd() as u64).collect();
    seccomp(&shared, &recvmsg_on)?;
    Ok((nix::unistd::getuid().as_raw(), landlock))
}

fn become_user(uid: u32, gid: u32) -> Result<(), String> {
    use nix::unistd::{setgid, setgroups, setuid, Gid, Uid};
    setgroups(&[Gid::from_raw(gid)]).map_err(|e| format!("confine: setgroups: {e}"))?;
    setgid(Gid::from_raw(gid)).map_err(|e| format!("confine: setgid({gid}): {e}"))?;
    setuid(Uid::from_raw(uid)).map_err(|e| format!("confine: setuid({uid}): {e}"))?;
    // No way back.
    if setuid(Uid::from_raw(0)).is_ok() || nix::unistd::geteuid().as_raw() != uid {
        return Err("confine: the change of user did not hold".into());
    }
    Ok(())
}

/// Capabilities a unit grants `serve` (`CAP_NET_BIND_SERVICE`, ambient) would pass to the child
/// through `execve`: all are dropped, the ambient set first. The child binds no privileged port.
fn drop_capabilities() -> Result<(), String> {
    use rustix::thread::{CapabilitySet, CapabilitySets};
    rustix::thread::clear_ambient_capability_set()
        .map_err(|e| format!("confine: clearing the ambient capabilities: {e}"))?;
    rustix::thread::set_capabilities(
        None,
        CapabilitySets {
            effective: CapabilitySet::empty(),
            permitted: CapabilitySet::empty(),
            inheritable: CapabilitySet::empty(),
        },
    )
    .map_err(|e| format!("confine: dropping capabilities: {e}"))
}

/// Every file-system right, TCP bind and connect, signals and abstract sockets outside: all
/// handled; reading files and listing directories granted beneath `read_beneath` only.
fn landlock(read_beneath: &[BorrowedFd<'_>]) -> Result<String, String> {
    let abi = ABI::V6;
    let read = AccessFs::ReadFile | AccessFs::ReadDir;
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .and_then(|r| r.handle_access(AccessNet::from_all(abi)))
        .and_then(|r| r.scope(Scope::from_all(abi)))
        .and_then(|r| r.create())
        .and_then(|r| {
            r.add_rules(
                read_beneath
                    .iter()
                    .map(|fd| Ok::<_, landlock::RulesetError>(PathBeneath::new(*fd, read))),
            )
        })
        .and_then(|r| r.restrict_self())
        .map_err(|e| format!("confine: Landlock: {e}"))?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => "enforced",
        RulesetStatus::PartiallyEnforced => "partly enforced (an older kernel)",
        RulesetStatus::NotEnforced => "not available",
    }
    .to_string())
}

/// The system calls a tokio + rustls server uses once its sockets exist (found with
/// `strace -f` on the child under the test suite and the join benchmark, glibc and musl).
fn allowed() -> Vec<i64> {
    use libc::*;
    let mut v = vec![
        SYS_read,
        SYS_write,
        SYS_readv,
        SYS_writev,
        SYS_pread64,
        SYS_close,
        SYS_fstat,
        SYS_newfstatat,
        SYS_statx,
        SYS_lseek,
        SYS_mmap,
        SYS_munmap,
        SYS_mremap,
        SYS_mprotect,
        SYS_madvise,
        SYS_brk,
        SYS_rt_sigaction,
        SYS_rt_sigprocmask,
        SYS_rt_sigreturn,
        SYS_sigaltstack,
        SYS_futex,
        SYS_sched_yield,
        SYS_sched_getaffinity,
        SYS_getrandom,
        SYS_clock_gettime,
        SYS_clock_nanosleep,
        SYS_nanosleep,
        SYS_gettid,
        SYS_getpid,
        SYS_getuid,
        SYS_geteuid,
        SYS_getgid,
        SYS_getegid,
        SYS_exit,
        SYS_exit_group,
        SYS_epoll_create1,
        SYS_epoll_ctl,
        SYS_epoll_pwait,
        SYS_epoll_pwait2,
        SYS_eventfd2,
        SYS_accept4,
        SYS_recvfrom,
        SYS_sendto,
        SYS_getsockopt,
        SYS_getsockname,
        SYS_getpeername,
        SYS_clone3,
        SYS_set_robust_list,
        SYS_rseq,
        SYS_prctl,
        SYS_membarrier,
        SYS_openat,
        SYS_openat2,
        SYS_faccessat,
        SYS_faccessat2,
        SYS_uname,
        SYS_sched_getparam,
        SYS_sched_getscheduler,
        SYS_restart_syscall,
        SYS_set_tid_address,
        // mimalloc asks which CPU and NUMA node a new thread runs on when the host has more than
        // one node (and, in the static build, it is C's allocator too).
        SYS_getcpu,
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([
        SYS_open,
        SYS_access,
        SYS_stat,
        SYS_poll,
        SYS_epoll_wait,
        SYS_accept,
        SYS_arch_prctl,
    ]);
    v
}

fn seccomp(shared: &[u64], recvmsg_on: &[u64]) -> Result<(), String> {
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("confine: seccomp on {}: {e:?}", std::env::consts::ARCH))?;
    let rule = |conds: &[(u8, SeccompCmpArgLen, SeccompCmpOp, u64)]| {
        conds
            .iter()
            .map(|(arg, len, op, v)| SeccompCondition::new(*arg, len.clone(), op.clone(), *v))
            .collect::<Result<Vec<_>, _>>()
            .and_then(SeccompRule::new)
            .map_err(|e| format!("confine: seccomp rule: {e}"))
    };
    let cond =
        |arg: u8, op: SeccompCmpOp, value: u64| rule(&[(arg, SeccompCmpArgLen::Qword, op, value)]);
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        allowed().into_iter().map(|n| (n, Vec::new())).collect();
    // Threads, never processes.
    let thread = libc::CLONE_THREAD as u64;
    rules.insert(
        libc::SYS_clone,
        vec![cond(0, SeccompCmpOp::MaskedEq(thread), thread)?],
    );
    // The runtime's signal pipe (a Unix stream pair); no other socket.
    rules.insert(
        libc::SYS_socketpair,
        vec![rule(&[
            (
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                libc::AF_UNIX as u64,
            ),
            (
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(0xf),
                libc::SOCK_STREAM as u64,
            ),
        ])?],
    );
    // TFTP gives each transfer a port of its own: UDP sockets (IPv4 or IPv6), bound to an
    // ephemeral port (a privileged one needs a capability the child has dropped) and connected
    // to the client. No TCP socket: Landlock refuses TCP bind and connect besides.
    rules.insert(
        libc::SYS_socket,
        [libc::AF_INET, libc::AF_INET6]
            .into_iter()
            .flat_map(|family| [(family, 0), (family, libc::IPPROTO_UDP)])
            .map(|(family, protocol)| {
                rule(&[
                    (0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, family as u64),
                    (
                        1,
                        SeccompCmpArgLen::Dword,
                        SeccompCmpOp::MaskedEq(0xf),
                        libc::SOCK_DGRAM as u64,
                    ),
                    (
                        2,
                        SeccompCmpArgLen::Dword,
                        SeccompCmpOp::Eq,
                        protocol as u64,
                    ),
                ])
            })
            .collect::<Result<_, _>>()?,
    );
    // The sockets the parent shares with every child it starts: a child must not connect,
    // rebind, shut down or reconfigure one (a filter attached, a buffer shrunk), which would
    // outlive it and break DHCP, TFTP or HTTP for its successors. Its own sockets (TFTP's
    // transfers, accepted connections) are free. No shared descriptor can be copied to escape
    // the rule: `dup*` are not allowed, `fcntl` copies only other descriptors, and with no
    // `sendmsg` or `recvmsg` no descriptor can be passed to itself over a socketpair (the child
    // receives its descriptors before it confines itself; after, it reads and writes).
    let not_shared = shared
        .iter()
        .map(|fd| (0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, *fd))
        .collect::<Vec<_>>();
    for call in [
        libc::SYS_connect,
        libc::SYS_bind,
        libc::SYS_shutdown,
        libc::SYS_setsockopt,
    ] {
        let r = if not_shared.is_empty() {
            Vec::new()
        } else {
            vec![rule(&not_shared)?]
        };
        rules.insert(call, r);
    }
    // `recvmsg` on the DHCP sockets alone: a UDP socket carries no descriptor (SCM_RIGHTS is a
    // Unix socket's), so this opens no way to pass one over the socketpair.
    if !recvmsg_on.is_empty() {
        rules.insert(
            libc::SYS_recvmsg,
            recvmsg_on
                .iter()
                .map(|fd| rule(&[(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, *fd)]))
                .collect::<Result<_, _>>()?,
        );
    }
    let mut fcntl: Vec<SeccompRule> = [libc::F_GETFD, libc::F_SETFD, libc::F_GETFL, libc::F_SETFL]
        .into_iter()
        .map(|cmd| rule(&[(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, cmd as u64)]))
        .collect::<Result<_, _>>()?;
    // tokio's signal driver copies its own pipe's end; a shared socket is never copied.
    let mut dup = vec![(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        libc::F_DUPFD_CLOEXEC as u64,
    )];
    dup.extend(not_shared.iter().cloned());
    fcntl.push(rule(&dup)?);
    rules.insert(libc::SYS_fcntl, fcntl);
    // Non-blocking and close-on-exec flags, and asking whether stderr is a terminal (glibc and
    // musl ask differently); no other
    // ioctl (no TIOCSTI into a terminal, no device).
    rules.insert(
        libc::SYS_ioctl,
        [
            libc::FIONBIO,
            libc::FIOCLEX,
            libc::FIONCLEX,
            libc::TCGETS,
            libc::TIOCGWINSZ,
        ]
        .into_iter()
        // The request's type is c_ulong with glibc and c_int with musl.
        .map(|req| {
            #[allow(clippy::unnecessary_cast)]
            let req = req as u64;
            rule(&[(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, req)])
        })
        .collect::<Result<_, _>>()?,
    );
    // A signal to this process only (abort's SIGABRT): never to the parent, which may share
    // the user.
    rules.insert(
        libc::SYS_tgkill,
        vec![cond(0, SeccompCmpOp::Eq, std::process::id() as u64)?],
    );
    let allow: BpfProgram = SeccompFilter::new(
        rules,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        arch,
    )
    .and_then(|f| f.try_into())
    .map_err(|e| format!("confine: seccomp filter: {e}"))?;
    // clone3's flags are out of the filter's reach: ENOSYS makes the C library use clone.
    let no_clone3: BpfProgram = SeccompFilter::new(
        [(libc::SYS_clone3, Vec::new())].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .and_then(|f| f.try_into())
    .map_err(|e| format!("confine: seccomp filter: {e}"))?;
    // The allow-list last: it does not allow `seccomp` itself.
    seccompiler::apply_filter(&no_clone3).map_err(|e| format!("confine: seccomp: {e}"))?;
    seccompiler::apply_filter(&allow).map_err(|e| format!("confine: seccomp: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::process::ExitStatusExt;

    const CASE: &str = "BCA_CONFINE_CASE";

    /// Runs one case of [`confined_case_helper`] in a new process of this test binary, confined
    /// as the network child is (a filter is for good: it cannot be tried in the test's own
    /// process); its exit status.
    fn run_confined(case: &str) -> std::process::ExitStatus {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &format!(
                    "{}::confined_case_helper",
                    module_path!().trim_start_matches("bca::")
                ),
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CASE, case)
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap()
    }

    /// Not a test of its own: the body [`run_confined`] runs in a separate process.
    #[test]
    fn confined_case_helper() {
        let Ok(case) = std::env::var(CASE) else {
            return;
        };
        let shared = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        confine(None, &[], &[shared.as_fd()], &[]).unwrap();
        let peer = "127.0.0.1:9";
        match case.as_str() {
            "own" => {
                let own = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                own.connect(peer).unwrap();
                own.set_broadcast(true).unwrap();
            }
            "shared-connect" => {
                let _ = shared.connect(peer);
            }
            "shared-setsockopt" => {
                let _ = shared.set_broadcast(true);
            }
            "dup" => {
                let _ = shared.try_clone();
            }
            "tcp" => {
                let _ = std::net::TcpListener::bind("127.0.0.1:0");
            }
            "open" => {
                // Landlock, not seccomp: refused, and the process lives on.
                if std::fs::File::open("/etc/hostname").is_ok() {
                    std::process::exit(3);
                }
            }
            other => panic!("no case {other}"),
        }
        std::process::exit(0);
    }

    #[test]
    fn the_filter_keeps_the_shared_sockets_as_the_parent_handed_them() {
        assert!(run_confined("own").success(), "its own UDP socket");
        assert!(run_confined("open").success(), "no file outside");
        for case in ["shared-connect", "shared-setsockopt", "dup", "tcp"] {
            let st = run_confined(case);
            assert_eq!(st.signal(), Some(libc::SIGSYS), "{case}: {st:?}");
        }
    }
}
