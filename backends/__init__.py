"""GDN backends. Each subpackage registers one backend with gdnkit.dispatch; none imports another."""
