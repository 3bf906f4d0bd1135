//! What the tests that run near a process's limits share. Each such test is a binary of its own:
//! a limit holds for the whole process, which no other test may share.

/// Caps the process's address space (`RLIMIT_AS`, what `ulimit -v` sets) at what it maps now plus
/// `headroom` bytes. Past the cap the OS refuses mappings for real (`ENOMEM`): large blocks, and
/// the stacks of new threads.
pub fn cap_address_space(headroom: usize) {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    let line = status.lines().find(|l| l.starts_with("VmSize:")).expect("a VmSize line");
    let kib: usize = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmSize in kB");
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on a valid struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_AS, &mut limit), 0);
        limit.rlim_cur = ((kib * 1024 + headroom) as libc::rlim_t).min(limit.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_AS, &limit), 0);
    }
}
