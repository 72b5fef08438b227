package routerconfig

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gateway"
)

// TestHalfWrittenFileIsNotApplied is the sequence: the file is
// truncated, written without api_keys (a document that parses and
// validates), left so for 1 s, then completed. Applied, the half would serve
// unauthenticated clients for as long as it stood.
func TestHalfWrittenFileIsNotApplied(t *testing.T) {
	if testing.Short() {
		t.Skip("writes with 1 s pauses")
	}
	const (
		head = "default_tokenizer: builtin\nstatic_upstreams: [{name: s, url: 'http://127.0.0.1:9', models: [m]}]\n"
		tail = "api_keys: [k1]\n"
	)
	r := appliedReloader(t, head+tail)
	path := r.Path
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var applied atomic.Int64
	if err := r.Watch(ctx, func() { applied.Add(1) }); err != nil {
		t.Fatal(err)
	}
	var open atomic.Int64 // polls that found no client key in force
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if len(r.Gateway.Settings().APIKeys) == 0 {
				open.Add(1)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	for range 3 {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteString(head); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second)
		if _, err := f.WriteString(tail); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	deadline := time.Now().Add(10 * time.Second)
	for (applied.Load() < 1 || len(r.Gateway.Settings().APIKeys) == 0) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	<-done
	if open.Load() != 0 {
		t.Errorf("the file without api_keys was in force for %d polls (5 ms apart)", open.Load())
	}
	if applied.Load() < 1 || len(r.Gateway.Settings().APIKeys) != 1 {
		t.Errorf("the whole file was not applied after the writes: %d applied, keys %v", applied.Load(), r.Gateway.Settings().APIKeys)
	}
}

// TestSettleWaitsForTwoAgreeingReads: a file whose later writes raised no
// event (an overflowed queue, a network file system) is read until two reads
// agree; what is applied is what they read.
func TestSettleWaitsForTwoAgreeingReads(t *testing.T) {
	reads := []string{"head\n", "head\ntail\n", "head\ntail\n"}
	var n, unsettled atomic.Int64
	read := func() ([]byte, error) {
		i := min(int(n.Add(1))-1, len(reads)-1)
		return []byte(reads[i]), nil
	}
	got := make(chan string, 4)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changes := make(chan struct{}, 1)
	go settle(ctx, changes, 10*time.Millisecond, read, func(data []byte, err error) { got <- string(data) }, func() { unsettled.Add(1) })
	changes <- struct{}{}
	select {
	case s := <-got:
		if s != "head\ntail\n" || n.Load() != 3 || unsettled.Load() != 1 {
			t.Fatalf("applied %q after %d reads, %d unsettled; want the whole file after 3 reads, 1 unsettled", s, n.Load(), unsettled.Load())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("nothing applied")
	}
	select {
	case s := <-got:
		t.Fatalf("applied %q again without a change", s)
	case <-time.After(50 * time.Millisecond):
	}
}

// TestHugeFileIsRefusedUnread: 300 MB decoded took 1.8 GB and 20 s; over
// the limit the file is not read at all and the configuration stays.
func TestHugeFileIsRefusedUnread(t *testing.T) {
	r := appliedReloader(t, "api_keys: [k1]\n")
	path := r.Path
	// Sparse: the test writes nothing, the router would read 300 MB.
	if err := os.Truncate(path, 300<<20); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err := r.Reload()
	if !errors.Is(err, ErrTooLarge) || len(r.Gateway.Settings().APIKeys) != 1 {
		t.Fatalf("300 MB file: %v, keys %v; want ErrTooLarge and the keys kept", err, r.Gateway.Settings().APIKeys)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("refusing took %v: the file was read", took)
	}
	if _, err := Load(path, DefaultMaxBytes, 0); !errors.Is(err, ErrTooLarge) {
		t.Errorf("at start: %v, want ErrTooLarge", err)
	}
	if _, err := ReadFile("/dev/zero", DefaultMaxBytes); err == nil {
		t.Error("a device was read as a config file")
	}
	var m dto.Metric
	if err := r.metrics().results.WithLabelValues(resultTooLarge).Write(&m); err != nil || m.GetCounter().GetValue() != 1 {
		t.Errorf("too_large counted %v (%v), want 1", m.GetCounter().GetValue(), err)
	}
}

// TestStartWaitsForAFileJustWritten: a router starting while the file is
// written in place reads it until it settles, so the half it may find first
// is not what it starts with.
func TestStartWaitsForAFileJustWritten(t *testing.T) {
	path := filepath.Join(t.TempDir(), "router.yaml")
	if err := os.WriteFile(path, []byte("policy: random\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(100 * time.Millisecond)
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		if err == nil {
			_, _ = f.WriteString("api_keys: [k1]\n")
			_ = f.Close()
		}
	}()
	c, err := Load(path, DefaultMaxBytes, 300*time.Millisecond)
	if err != nil || len(c.APIKeys) != 1 {
		t.Fatalf("started with %+v (%v); want the whole file", c, err)
	}
	// Unmodified for longer than the settle time: no wait.
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(path, old, old); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := Load(path, DefaultMaxBytes, time.Minute); err != nil || time.Since(start) > time.Second {
		t.Fatalf("an old file took %v to load (%v)", time.Since(start), err)
	}
}

// appliedReloader returns a Reloader of a file holding doc, applied.
func appliedReloader(t *testing.T, doc string) *Reloader {
	t.Helper()
	path := filepath.Join(t.TempDir(), "router.yaml")
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	table := fleet.NewTable(fleet.TableConfig{})
	r := &Reloader{Base: &Config{}, Path: path, Builder: &Builder{Table: table}, Log: zerolog.Nop()}
	r.Gateway = gateway.New(table, nil, gateway.Settings{}, zerolog.Nop())
	if err := r.Reload(); err != nil {
		t.Fatal(err)
	}
	return r
}
