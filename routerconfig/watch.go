package routerconfig

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// DefaultSettle is how long a changed config file must stay the same before
// it is applied. A file written in place passes through documents that
// parse (cut at a line, it may just lack api_keys: every client served
// unauthenticated); only time tells them from the whole. Two seconds covers
// a writer pausing a second mid-file with room to spare; replacing the file
// by rename needs no settling at all and is the supported way.
const DefaultSettle = 2 * time.Second

// maxUnsettledReads bounds the reads at start of a file that keeps changing.
const maxUnsettledReads = 10

// ReadSettled reads the file at path once it has stayed the same for
// settle: at once if it was last modified longer ago than that (plus a
// second, for file systems keeping whole seconds) and not during the read,
// else when two reads settle apart return the same bytes. A file still
// changing after maxUnsettledReads reads is an error. settle 0 reads once.
func ReadSettled(path string, maxBytes int64, settle time.Duration) ([]byte, error) {
	var last []byte
	for i := 0; ; i++ {
		before, _ := os.Stat(path)
		data, err := ReadFile(path, maxBytes)
		if err != nil {
			return nil, err
		}
		if settle <= 0 || (i > 0 && bytes.Equal(data, last)) || unmodifiedFor(path, before, settle+time.Second) {
			return data, nil
		}
		if i == maxUnsettledReads {
			return nil, fmt.Errorf("config: %s still changing after %v; write it beside and rename it into place", path, time.Duration(i)*settle)
		}
		last = data
		time.Sleep(settle)
	}
}

// unmodifiedFor reports whether path, as before was taken, is still the same
// file, unmodified for at least d.
func unmodifiedFor(path string, before os.FileInfo, d time.Duration) bool {
	after, err := os.Stat(path)
	return err == nil && before != nil && os.SameFile(before, after) && after.Size() == before.Size() &&
		after.ModTime().Equal(before.ModTime()) && time.Since(after.ModTime()) >= d
}

// Watch applies the file each time it is written, created or renamed into
// place (editors and Kubernetes ConfigMaps replace files rather than write
// them) and has then settled for r.Settle; applied, if not nil, runs after
// each change applied. It watches the directory, so the file may be absent
// for a while. It returns at once, or with an error if the directory cannot
// be watched; watching ends with ctx.
func (r *Reloader) Watch(ctx context.Context, applied func()) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	abs, err := filepath.Abs(r.Path)
	if err != nil {
		_ = w.Close()
		return err
	}
	if err := w.Add(filepath.Dir(abs)); err != nil {
		_ = w.Close()
		return err
	}
	changes := make(chan struct{}, 1)
	changed := func() {
		select {
		case changes <- struct{}{}:
		default:
		}
	}
	go func() {
		defer w.Close()
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				// A ConfigMap swaps a ..data symlink: any event in the
				// directory may change what path resolves to.
				if filepath.Clean(ev.Name) == abs || filepath.Base(ev.Name) == "..data" {
					changed()
				}
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				// An overflowed event queue may have dropped the file's.
				r.Log.Warn().Err(err).Msg("config watch: a change may have gone unseen; reading the file again")
				changed()
			}
		}
	}()
	read := func() ([]byte, error) { return ReadFile(r.Path, r.maxBytes()) }
	apply := func(data []byte, err error) {
		if r.apply(data, err) == nil && applied != nil {
			applied()
		}
	}
	go settle(ctx, changes, r.settle(), read, apply, r.metrics().unsettled.Inc)
	return nil
}

// settle calls apply with what read returns once a change signalled on
// changes has settled: no further change for d, and the reads at its middle
// and at its end agreeing. The second read catches writes whose events were
// lost (an overflowed queue, network file systems); a file that keeps
// changing is read again every d/2 until it stops, never applied half-way
// (unsettled counts each such disagreement).
func settle(ctx context.Context, changes <-chan struct{}, d time.Duration, read func() ([]byte, error), apply func([]byte, error), unsettled func()) {
	timer := time.NewTimer(d / 2)
	timer.Stop()
	defer timer.Stop()
	var fire <-chan time.Time
	var first *readResult
	for {
		select {
		case <-ctx.Done():
			return
		case <-changes:
			first = nil
			timer.Reset(d / 2)
			fire = timer.C
		case <-fire:
			data, err := read()
			got := &readResult{data, err}
			if first != nil && first.same(got) {
				first, fire = nil, nil
				apply(data, err)
				continue
			}
			if first != nil {
				unsettled()
			}
			first = got
			timer.Reset(d / 2)
		}
	}
}

// readResult is one read of the file: a refusal (too large, absent) must
// settle like content, so a file caught mid-replacement is not reported.
type readResult struct {
	data []byte
	err  error
}

func (a *readResult) same(b *readResult) bool {
	if a.err != nil || b.err != nil {
		return a.err != nil && b.err != nil && a.err.Error() == b.err.Error()
	}
	return bytes.Equal(a.data, b.data)
}
