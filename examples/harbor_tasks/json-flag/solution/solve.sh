#!/bin/bash
sed -i "s/\"debug\": false/\"debug\": true/" config.json
