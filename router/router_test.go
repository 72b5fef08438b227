package router

import (
	"context"
	"strings"
	"testing"
	"time"
)

func valid() Config {
	return Config{Listen: "127.0.0.1:0", MaxBodyBytes: 1 << 20, ConfigMaxBytes: 1 << 20, ConfigSettle: time.Second,
		OrphanProbe: time.Second, OrphanForget: time.Minute, DrainTimeout: time.Second}
}

// Run refuses a Config it cannot serve before it opens anything.
func TestRunRefusesBadConfig(t *testing.T) {
	for want, edit := range map[string]func(*Config){
		"--max-body-bytes":        func(c *Config) { c.MaxBodyBytes = 0 },
		"--config-settle":         func(c *Config) { c.ConfigSettle = 0 },
		"exclude each other":      func(c *Config) { c.AdminOpen, c.AdminToken = true, "t" },
		"go together":             func(c *Config) { c.TLSCert = "cert.pem" },
		"--orphan-forget-after":   func(c *Config) { c.OrphanForget = 0 },
		`unknown policy "faster"`: func(c *Config) { c.Flags.Policy = "faster" },
	} {
		c := valid()
		edit(&c)
		if err := Run(context.Background(), c); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v", want, err)
		}
	}
}
