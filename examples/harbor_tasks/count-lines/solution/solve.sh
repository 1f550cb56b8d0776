#!/bin/bash
wc -l < data/items.txt > count.txt
