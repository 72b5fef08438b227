// Package certfile serves a TLS certificate from PEM files and picks up a
// renewed pair without a restart (cert-manager, certbot and friends replace
// the files in place), checking the files' modification times at most once
// per interval.
package certfile

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"sync"
	"time"
)

// Source is a certificate kept in step with its files. Use GetCertificate
// in a tls.Config.
type Source struct {
	certPath, keyPath string
	interval          time.Duration

	mu      sync.Mutex
	cert    *tls.Certificate
	stamp   [2]time.Time // modification times the certificate was read at
	checked time.Time
	lastErr error
}

// Load reads the pair once (an error if it is unusable) and returns a
// Source that rechecks the files at most every interval (10 s when 0).
func Load(certPath, keyPath string, interval time.Duration) (*Source, error) {
	if interval <= 0 {
		interval = 10 * time.Second
	}
	s := &Source{certPath: certPath, keyPath: keyPath, interval: interval}
	if err := s.reloadLocked(); err != nil { // not shared yet: no lock needed
		return nil, err
	}
	return s, nil
}

// GetCertificate implements tls.Config.GetCertificate. A pair that fails
// to load after a change keeps the previous certificate in use; Err
// reports why.
func (s *Source) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if now := time.Now(); now.Sub(s.checked) >= s.interval {
		s.checked = now
		if stamp, err := s.stamps(); err == nil && stamp != s.stamp {
			s.lastErr = s.reloadLocked()
		}
	}
	return s.cert, nil
}

// Err is the error of the last failed reload, nil once one succeeds.
func (s *Source) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastErr
}

// Config is a server tls.Config serving the Source's certificate.
func (s *Source) Config() *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: s.GetCertificate}
}

func (s *Source) reloadLocked() error {
	stamp, err := s.stamps()
	if err != nil {
		return err
	}
	cert, err := tls.LoadX509KeyPair(s.certPath, s.keyPath)
	if err != nil {
		return fmt.Errorf("certfile: %w", err)
	}
	s.cert, s.stamp, s.checked = &cert, stamp, time.Now()
	return nil
}

func (s *Source) stamps() ([2]time.Time, error) {
	var out [2]time.Time
	for i, p := range []string{s.certPath, s.keyPath} {
		fi, err := os.Stat(p)
		if err != nil {
			return out, fmt.Errorf("certfile: %w", err)
		}
		out[i] = fi.ModTime()
	}
	return out, nil
}

// SelfSigned makes a self-signed ECDSA P-256 certificate for hosts (DNS
// names or IP addresses), valid from an hour ago for validFor, as PEM: for
// tests and local demos, never for clients that must trust the router.
func SelfSigned(hosts []string, validFor time.Duration) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: "kvmesh"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(validFor),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), nil
}
