"""kvgate's HTTP surface."""
