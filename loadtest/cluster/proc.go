package cluster

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Proc is one child process in its own process group, so stopping it also
// stops anything it started and a terminal's Ctrl-C reaches only the load
// test, which then tears the cluster down in order.
type Proc struct {
	Name    string
	LogPath string
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
	stop    sync.Once
	// dead is set by Kill: the process was taken away on purpose.
	dead atomic.Bool
}

// StartProc starts bin with args, stdout and stderr appended to logPath,
// and env as its environment (nil: this process's).
func StartProc(name, bin string, args, env []string, logPath string) (*Proc, error) {
	if err := os.MkdirAll(filepath.Dir(logPath), 0o755); err != nil {
		return nil, err
	}
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(logf, "# %s %s\n", bin, strings.Join(args, " "))
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = env
	// Pdeathsig: if the load test itself is killed, the kernel kills the
	// children; Setpgid: signals go to the child's whole group.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Proc{Name: name, LogPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

// Pid returns the child's pid, which is also its process group id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// userHZ is the unit of /proc's CPU times: fixed at 100 for user space
// whatever the kernel's own tick (proc(5)).
const userHZ = 100

// CPU returns the CPU time (user + system, all threads) the process has
// used so far; false once it is gone.
func (p *Proc) CPU() (time.Duration, bool) {
	f := statFields(p.Pid())
	// After the command name: state is field 3 of proc(5), utime 14, stime 15.
	if len(f) < 13 {
		return 0, false
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(utime+stime) * time.Second / userHZ, true
}

// Exited reports whether the process has ended, and how.
func (p *Proc) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.waitErr
	default:
		return false, nil
	}
}

// signalGroup signals the process group; ESRCH (already gone) is fine.
func (p *Proc) signalGroup(sig syscall.Signal) {
	if err := syscall.Kill(-p.Pid(), sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		_ = p.cmd.Process.Signal(sig)
	}
}

// Stop sends SIGTERM to the group, then SIGKILL after grace, and waits for
// the process to be reaped. It reports whether SIGKILL was needed. Safe to
// call more than once and concurrently.
func (p *Proc) Stop(grace time.Duration) (killed bool) {
	p.stop.Do(func() {
		defer p.awaitGroupGone(time.Second)
		select {
		case <-p.done:
			// The leader is gone; sweep any group members it left behind.
			p.signalGroup(syscall.SIGKILL)
			return
		default:
		}
		p.signalGroup(syscall.SIGTERM)
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-p.done:
		case <-t.C:
			killed = true
			p.signalGroup(syscall.SIGKILL)
			<-p.done
		}
		// Children that ignored SIGTERM while the leader exited.
		p.signalGroup(syscall.SIGKILL)
	})
	return killed
}

// Kill sends SIGKILL to the group at once, as a crashed or lost machine
// takes a server away (no SIGTERM, no drain), and waits for the process
// to be reaped. The process counts as stopped: a later Stop only sweeps
// the group.
func (p *Proc) Kill() {
	p.stop.Do(func() {
		p.dead.Store(true)
		p.signalGroup(syscall.SIGKILL)
		<-p.done
		p.awaitGroupGone(time.Second)
	})
}

// awaitGroupGone waits, up to max, until no live process is left in the
// group: a killed child leaves /proc a moment after SIGKILL, and callers
// (the next run's leftover check above all) expect Stop to mean gone.
func (p *Proc) awaitGroupGone(max time.Duration) {
	deadline := time.Now().Add(max)
	for len(liveInGroup(p.Pid())) > 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
}

// liveInGroup lists the live (non-zombie) processes whose process group is
// pgid, from /proc (Linux; elsewhere none).
func liveInGroup(pgid int) []int {
	var out []int
	for _, pid := range procs() {
		f := statFields(pid) // state ppid pgrp ...
		if len(f) < 3 || f[0] == "Z" {
			continue
		}
		if g, _ := strconv.Atoi(f[2]); g == pgid {
			out = append(out, pid)
		}
	}
	return out
}

// procs lists the processes in /proc (Linux; elsewhere none).
func procs() []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, pid)
		}
	}
	return out
}

// statFields returns the fields of /proc/pid/stat after the command name,
// the state first; nil if the process is gone. (The command name may
// contain spaces and parentheses: it ends at the last ')'.)
func statFields(pid int) []string {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(data, ')')
	if i < 0 || i+2 > len(data) {
		return nil
	}
	return strings.Fields(string(data[i+2:]))
}

// TailLog returns up to the last n bytes of the process's log.
func (p *Proc) TailLog(n int) string {
	data, err := os.ReadFile(p.LogPath)
	if err != nil {
		return ""
	}
	if len(data) > n {
		data = data[len(data)-n:]
	}
	return string(data)
}

// Leftovers lists live (non-zombie) processes whose environment contains
// the entry marker (e.g. RunEnv+"="+RunID): what a crashed load test may
// have left behind. Linux only; elsewhere it finds nothing.
func Leftovers(marker string) []int {
	var out []int
	for _, pid := range procs() {
		if pid == os.Getpid() {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "environ"))
		if err != nil || !bytes.Contains(append(append([]byte{0}, env...), 0), []byte("\x00"+marker+"\x00")) {
			continue
		}
		if f := statFields(pid); len(f) > 0 && f[0] == "Z" {
			continue
		}
		out = append(out, pid)
	}
	return out
}
