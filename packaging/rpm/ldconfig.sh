#!/bin/sh
# The shared library cache knows libhpshard.so.MAJOR (Fedora: %post/%postun -p /sbin/ldconfig).
/sbin/ldconfig
