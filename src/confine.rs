//! How the network child ([`crate::privsep`]) confines itself before it reads from the network:
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
use std::os::fd::BorrowedFd;

/// Confines the calling process; returns the uid it now runs as and what Landlock enforced.
/// `read_beneath`: directories (held open) whose files may be read; nothing else may.
pub fn confine(
    user: Option<(u32, u32)>,
    read_beneath: &[BorrowedFd<'_>],
) -> Result<(u32, String), String> {
    if let Some((uid, gid)) = user {
        become_user(uid, gid)?;
    }
    drop_capabilities()?;
    // After the change of user, which clears it: the child dies with its parent.
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .map_err(|e| format!("confine: PR_SET_PDEATHSIG: {e}"))?;
    let landlock = landlock(read_beneath)?;
    seccomp()?;
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
        SYS_recvmsg,
        SYS_sendmsg,
        SYS_shutdown,
        SYS_getsockopt,
        SYS_setsockopt,
        SYS_getsockname,
        SYS_bind,
        SYS_connect,
        SYS_getpeername,
        SYS_fcntl,
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

fn seccomp() -> Result<(), String> {
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
            .map(|family| {
                rule(&[
                    (0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, family as u64),
                    (
                        1,
                        SeccompCmpArgLen::Dword,
                        SeccompCmpOp::MaskedEq(0xf),
                        libc::SOCK_DGRAM as u64,
                    ),
                ])
            })
            .collect::<Result<_, _>>()?,
    );
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
