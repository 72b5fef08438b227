package routerconfig

import (
	"context"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Watch calls changed each time the file at path is written, created or
// renamed into place (editors and Kubernetes ConfigMaps replace files
// rather than write them), coalescing bursts within debounce. It watches
// the directory, so the file may be absent for a while. It returns when
// ctx ends, or at once if the directory cannot be watched.
func Watch(ctx context.Context, path string, debounce time.Duration, changed func()) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		_ = w.Close()
		return err
	}
	if err := w.Add(filepath.Dir(abs)); err != nil {
		_ = w.Close()
		return err
	}
	go func() {
		defer w.Close()
		var timer *time.Timer
		var fire <-chan time.Time
		for {
			select {
			case <-ctx.Done():
				if timer != nil {
					timer.Stop()
				}
				return
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				// A ConfigMap swaps a ..data symlink: any event in the
				// directory may change what path resolves to.
				if filepath.Clean(ev.Name) != abs && filepath.Base(ev.Name) != "..data" {
					continue
				}
				if timer == nil {
					timer = time.NewTimer(debounce)
				} else {
					timer.Reset(debounce)
				}
				fire = timer.C
			case <-fire:
				fire = nil
				changed()
			case _, ok := <-w.Errors:
				if !ok {
					return
				}
			}
		}
	}()
	return nil
}
