#!/bin/bash
echo "Hi there" > greeting.txt
